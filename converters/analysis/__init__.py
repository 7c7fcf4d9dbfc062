"""Eligibility analysis: every Linear of a model, eligible for FP8 or with its reason codes (``Reason``), built
on the meta device; the one rule table both it and model-free jobs apply (``decide``); include/exclude patterns;
the text rendering of a report.
"""

from converters._lazy import lazy_exports

#: public name -> the module that defines it (loaded on first use: see converters._lazy)
_EXPORTS = {
    "AnalysisOptions": "converters.analysis.eligibility",
    "analyze_model": "converters.analysis.eligibility",
    "analyze_model_reference": "converters.analysis.eligibility",
    "Reason": "converters.analysis.reasons",
    "DecisionOptions": "converters.analysis.decision",
    "LayerDecision": "converters.analysis.decision",
    "LayerKind": "converters.analysis.decision",
    "LayerRecord": "converters.analysis.decision",
    "decide": "converters.analysis.decision",
    "eligible_paths": "converters.analysis.eligibility",
    "eligible_expert_units": "converters.analysis.eligibility",
    "converted_expert_gemms": "converters.analysis.eligibility",
    "check_include_patterns": "converters.analysis.eligibility",
    "refresh_totals": "converters.analysis.totals",
    "PatternError": "converters.analysis.patterns",
    "MAX_PATTERNS": "converters.analysis.patterns",
    "check_patterns": "converters.analysis.patterns",
    "validate_pattern": "converters.analysis.patterns",
    "matches": "converters.analysis.patterns",
    "format_analysis": "converters.analysis.render",
    "human_bytes": "converters.analysis.render",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
