// The report's accuracy blocks: end-to-end quality (held-out perplexity and KL of the training artifact and of
// each serving export against the source), the per-layer precision plan, and the amax swing across calibration
// steps. Each block says plainly when the report has none (reports written before these were measured).
(function () {
  'use strict';

  const fmt = function (v) { return window.fp8table.formatNumber(v); };
  const QUALITY_KEYS = ['perplexity', 'perplexity_reference', 'kl_mean', 'kl_max', 'top1_agreement'];

  function number(value, digits) { return typeof value === 'number' ? value.toFixed(digits) : '—'; }

  // The perplexity increase over the source's, in percent (null when either is missing).
  function increase(entry) {
    const ppl = entry.perplexity;
    const ref = entry.perplexity_reference;
    return typeof ppl === 'number' && typeof ref === 'number' && ref > 0 ? (100 * (ppl - ref)) / ref : null;
  }

  function qualityRow(id, name, kind, entry) {
    const rise = increase(entry);
    return {
      id: id, name: name, kind: kind, entry: entry,
      perplexity: number(entry.perplexity, 3), reference: number(entry.perplexity_reference, 3),
      increase: rise === null ? '—' : (rise >= 0 ? '+' : '') + rise.toFixed(2) + '%',
      klMean: fmt(entry.kl_mean), klMax: fmt(entry.kl_max),
      top1: typeof entry.top1_agreement === 'number' ? window.fp8.formatPercent(entry.top1_agreement) : '—',
      tokens: fmt(entry.tokens), texts: fmt(entry.texts),
      label: name + ': perplexity ' + number(entry.perplexity, 3) + ' against the source\'s ' +
        number(entry.perplexity_reference, 3) + ', mean KL ' + fmt(entry.kl_mean) + ', largest KL ' + fmt(entry.kl_max),
    };
  }

  // training first, then each serving export as written; entries that are not figures (an error) say so.
  function qualityRows(quality, recipeLabel) {
    const rows = [];
    if (quality.training) rows.push(qualityRow('quality-training', 'training artifact (' + recipeLabel + ')', 'training', quality.training));
    const serving = quality.serving || {};
    Object.keys(serving).forEach(function (name) {
      rows.push(qualityRow('quality-serving-' + name, name, 'serving export', serving[name]));
    });
    return rows.filter(function (row) {
      return row.entry && typeof row.entry === 'object' && QUALITY_KEYS.some(function (k) { return k in row.entry; });
    });
  }

  function describe(value) {
    if (value === null || value === undefined) return '';
    if (typeof value !== 'object') return String(value);
    return Object.keys(value).map(function (key) {
      const v = value[key];
      return key + ': ' + (v !== null && typeof v === 'object' ? JSON.stringify(v) : String(v));
    }).join('; ');
  }

  // plan.layers as a list of {path, ...} or an object keyed by path; the precision and its reason under any of
  // the names a plan uses for them.
  function planRows(plan) {
    const layers = plan.layers || {};
    const list = Array.isArray(layers) ? layers
      : Object.keys(layers).map(function (path) { return Object.assign({ path: path }, layers[path]); });
    return list.map(function (layer) {
      const precision = layer.precision || layer.choice || layer.format || layer.recipe || '';
      const why = layer.why || layer.reason || layer.because || '';
      const rest = Object.assign({}, layer);
      ['path', 'precision', 'choice', 'format', 'recipe', 'why', 'reason', 'because'].forEach(function (k) { delete rest[k]; });
      return {
        path: layer.path, href: '#' + window.fp8svg.rowId('layer', layer.path),
        precision: typeof precision === 'object' ? JSON.stringify(precision) : String(precision),
        why: typeof why === 'object' ? JSON.stringify(why) : String(why), figures: describe(rest),
      };
    });
  }

  function planFacts(plan) {
    return Object.keys(plan).filter(function (key) { return key !== 'layers'; }).map(function (key) {
      const value = plan[key];
      return { label: key.replace(/_/g, ' '), value: value !== null && typeof value === 'object' ? JSON.stringify(value) : String(value) };
    });
  }

  function swingRows(swing) {
    const layers = swing.layers || {};
    return Object.keys(layers).map(function (path) {
      const entry = layers[path];
      return {
        path: path, href: '#' + window.fp8svg.rowId('layer', path), ratio: entry.max_over_median,
        ratioText: typeof entry.max_over_median === 'number' ? entry.max_over_median.toFixed(2) + '×' : 'no step',
        steps: entry.steps, matters: Boolean(entry.matters),
      };
    }).sort(function (a, b) { return (b.ratio || 0) - (a.ratio || 0); });
  }

  // State and methods for the job page's accuracy blocks (refs: qualityCharts).
  function mixin() {
    return {
      quality: [],
      qualityText: '',
      heldOutText: '',
      plan: [],
      planFacts: [],
      planText: '',
      swing: [],
      swingText: '',
      swingReason: '',

      showAccuracy(report) {
        const label = (report.analysis && report.analysis.sensitivity && report.analysis.sensitivity.recipe &&
          report.analysis.sensitivity.recipe.label) || (report.recipe ? report.recipe.backend + ' ' + (report.recipe.scaling || report.recipe.recipe_name || '') : '');
        const quality = report.quality;
        this.quality = quality ? qualityRows(quality, label.trim()) : [];
        if (!quality) {
          this.qualityText = 'This report has no end-to-end quality figures: it was written by a version of fp8forge ' +
            'that did not measure them.';
        } else if (!this.quality.length) {
          this.qualityText = 'No quality figures were measured for this job' +
            (quality.reason || quality.skipped ? ': ' + (quality.reason || quality.skipped) : '') + '.';
        } else {
          this.qualityText = 'On held-out texts (never the calibration batches): each artifact\'s next-token ' +
            'predictions against the source model\'s.' +
            (quality.reference && typeof quality.reference.perplexity === 'number'
              ? ' Source perplexity ' + quality.reference.perplexity.toFixed(3) + '.' : '');
        }
        this.heldOutText = quality && quality.held_out ? 'Held-out data: ' + describe(quality.held_out) + '.' : '';

        const plan = report.plan;
        this.plan = plan ? planRows(plan) : [];
        this.planFacts = plan ? planFacts(plan) : [];
        this.planText = plan ? this.plan.length + ' layers planned.'
          : 'No precision plan in this report: the job did not ask for one (or was run by a version without plans).';

        const swing = report.amax_swing;
        this.swing = swing ? swingRows(swing) : [];
        const matters = this.swing.filter(function (row) { return row.matters; }).length;
        this.swingReason = swing && swing.reason ? swing.reason : '';
        this.swingText = !swing
          ? 'This report has no amax swing figures: it was written by a version of fp8forge that did not record them.'
          : matters + ' of ' + this.swing.length + ' layers\' ' + (swing.slot || 'input') + ' amax swings by ' +
            (swing.threshold || '') + '× or more (largest step over the median step) across the calibration steps; ' +
            (swing.recipe_stateless ? 'this recipe scales every step by itself (current scaling), so the swing costs it nothing.'
              : 'this recipe keeps a delayed scale, so those layers\' typical steps lose range: current scaling would not.');
        const self = this;
        this.$nextTick(function () { self.drawQuality(); });
      },

      drawQuality() {
        const box = this.$refs.qualityCharts;
        if (!box) return;
        box.replaceChildren();
        this.quality.forEach(function (row) {
          const figure = document.createElement('figure');
          figure.className = 'chart small';
          figure.id = row.id + '-chart';
          const ppl = document.createElement('div');
          ppl.className = 'svg-plot';
          ppl.setAttribute('role', 'img');
          ppl.setAttribute('aria-label', 'Bar chart, ' + row.label);
          const kl = document.createElement('div');
          kl.className = 'svg-plot';
          kl.setAttribute('role', 'img');
          kl.setAttribute('aria-label', 'Bar chart, ' + row.name + ': mean and largest per-token KL divergence');
          const caption = document.createElement('figcaption');
          caption.textContent = row.name + ' (' + row.kind + ')';
          figure.append(caption, ppl, kl);
          box.appendChild(figure);
          window.fp8svg.bars(ppl, {
            title: 'Perplexity', yLabel: 'perplexity',
            bars: [{ label: 'source', value: row.entry.perplexity_reference, color: 1 },
              { label: 'FP8', value: row.entry.perplexity, color: 0 }],
          });
          window.fp8svg.bars(kl, {
            title: 'KL divergence per token', yLabel: 'KL (nats)',
            bars: [{ label: 'mean', value: row.entry.kl_mean, color: 2 }, { label: 'largest', value: row.entry.kl_max, color: 3 }],
          });
        });
      },
    };
  }

  window.fp8quality = { mixin: mixin, qualityRows: qualityRows, increase: increase };
})();
