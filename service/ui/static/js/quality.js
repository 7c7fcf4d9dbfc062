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

  // The perplexity change against the source as "+0.42 (+0.12%)": what separates 350.31 from 349.89.
  function delta(entry) {
    const rise = increase(entry);
    if (rise === null) return '—';
    const points = entry.perplexity - entry.perplexity_reference;
    const sign = function (v) { return v >= 0 ? '+' : '−'; };
    return sign(points) + Math.abs(points).toFixed(3) + ' (' + sign(rise) + Math.abs(rise).toFixed(2) + '%)';
  }

  function qualityRow(id, name, kind, entry, short) {
    const rise = increase(entry);
    return {
      id: id, name: name, kind: kind, entry: entry, short: short || name, rise: rise,
      perplexity: number(entry.perplexity, 3), reference: number(entry.perplexity_reference, 3),
      increase: rise === null ? '—' : (rise >= 0 ? '+' : '') + rise.toFixed(2) + '%',
      delta: delta(entry), worse: rise !== null && rise > 0,
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
    if (quality.training) {
      rows.push(qualityRow('quality-training', 'training artifact (' + recipeLabel + ')', 'training', quality.training, 'training'));
    }
    const serving = quality.serving || {};
    Object.keys(serving).forEach(function (name) {
      rows.push(qualityRow('quality-serving-' + name, name, 'serving export', serving[name], name));
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

  // The plan's rows (converters/plan/planner.py: a list of {path, unit, precision, planned, why, sqnr_db, bytes, ...}).
  function planRows(plan) {
    return (plan.layers || []).map(function (layer) {
      const sqnr = layer.sqnr_db || {};
      return {
        path: layer.path, href: '#' + window.fp8svg.rowId('layer', layer.path), precision: String(layer.precision),
        unit: layer.unit && layer.unit !== layer.path ? layer.unit : '', planned: layer.planned !== false,
        why: String(layer.why || ''),
        sqnr: Object.keys(sqnr).map(function (p) { return p + ' ' + (typeof sqnr[p] === 'number' ? sqnr[p].toFixed(2) : '—'); }).join(', '),
        bytes: typeof layer.bytes === 'number' ? window.fp8.formatBytes(layer.bytes) + ' of ' + window.fp8.formatBytes(layer.bytes_bf16) : '',
      };
    });
  }

  function planFacts(plan) {
    const facts = [];
    const target = plan.target || {};
    if (target.name) facts.push(['Target', target.name + ' ' + target.value + (target.met === undefined ? '' : target.met ? ' (met)' : ' (not met)')]);
    if (plan.objective) facts.push(['Objective', plan.objective === 'memory' ? 'least memory' : 'most FP8 GEMM FLOPs']);
    const gpu = plan.gpu || {};
    if (gpu.name) {
      const notRun = gpu.not_run || {};
      facts.push(['GPU', gpu.name + ' (compute capability ' + gpu.compute_capability + '): ' + (gpu.precisions || []).join(', ') +
        (Object.keys(notRun).length ? '; not run: ' + Object.keys(notRun).map(function (p) { return p + ' (' + notRun[p] + ')'; }).join('; ') : '')]);
    }
    const totals = plan.totals || {};
    if (typeof totals.weight_bytes === 'number') {
      facts.push(['Weights', window.fp8.formatBytes(totals.weight_bytes) + ' against ' + window.fp8.formatBytes(totals.weight_bytes_bf16) +
        ' in bf16 (' + window.fp8.formatPercent(totals.memory_ratio) + ')']);
      facts.push(['FP8/FP4 share of GEMM FLOPs', window.fp8.formatPercent(totals.fp8_gemm_flop_share)]);
      const counts = totals.layers_per_precision || {};
      facts.push(['Layers per precision', Object.keys(counts).map(function (p) { return p + ' ' + counts[p]; }).join(', ')]);
    }
    const search = plan.search || {};
    if (search.method) facts.push(['Search', search.method + ' (' + search.units + ' units, ' + (search.verifications || []).length + ' measurement(s) of the whole plan)']);
    if (plan.files) facts.push(['Files', plan.files.join(', ')]);
    if (typeof plan.seconds === 'number') facts.push(['Planning time', plan.seconds.toFixed(1) + ' s']);
    return facts.map(function (pair) { return { label: pair[0], value: pair[1] }; });
  }

  // The plan measured end to end beside all-FP8 and all-bf16 (the source).
  function planMeasured(plan) {
    const measured = plan.measured || {};
    const names = { plan: 'this plan', all_fp8: 'all FP8', all_bf16: 'all bf16 (the source)' };
    return Object.keys(names).filter(function (key) { return measured[key]; }).map(function (key) {
      return qualityRow('plan-measured-' + key, names[key], 'plan', measured[key]);
    });
  }

  function notExpressible(plan) {
    const notes = plan.not_expressible || {};
    return Object.keys(notes).map(function (name) {
      const note = notes[name];
      return { name: name, text: typeof note === 'string' ? note : Array.isArray(note) ? note.join('; ') : JSON.stringify(note) };
    });
  }

  // With nvfp4_smoothing the job converted the smoothed model: that is the "source" every figure is measured against.
  function smoothingText(report) {
    const smoothing = report.calibration && report.calibration.nvfp4_smoothing;
    if (!smoothing || !smoothing.changed_tensors) return '';
    const counts = smoothing.mappings || {};
    return ' The source here is the smoothed model the job converted (nvfp4_smoothing ' + smoothing.method + ': ' +
      (counts.smoothed || 0) + ' mappings smoothed, ' + (counts.kept || 0) + ' kept, ' + (counts.skipped || 0) +
      ' skipped; each fold moved its layer\'s output by at most ' +
      Math.max.apply(null, smoothing.layers.map(function (layer) { return layer.output_change || 0; }))
        .toLocaleString('en', { style: 'percent', maximumFractionDigits: 2 }) + ').';
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
      planMeasured: [],
      planNotes: [],
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
              ? ' Source perplexity ' + quality.reference.perplexity.toFixed(3) + '.' : '') + smoothingText(report);
        }
        this.heldOutText = quality && quality.held_out ? 'Held-out data: ' + describe(quality.held_out) + '.' : '';

        const plan = report.plan && report.plan.made !== false ? report.plan : null;
        this.plan = plan ? planRows(plan) : [];
        this.planFacts = plan ? planFacts(plan) : [];
        this.planMeasured = plan ? planMeasured(plan) : [];
        this.planNotes = plan ? notExpressible(plan) : [];
        if (report.plan && report.plan.made === false) this.planText = 'No plan was made: ' + report.plan.reason;
        else if (!plan) this.planText = 'No precision plan in this report: the job did not ask for one (request field plan), or a version of fp8forge without plans wrote it.';
        else this.planText = 'Each layer\'s precision and why; the plan was measured end to end after it was made, beside all-FP8 and all-bf16.';

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

      // Two charts over every artifact, each bar labelled by its artifact (the training recipe or the export's
      // format): the perplexity change against the source in percent (an axis from zero made 350.31 and 349.89
      // look equal), and the mean and largest per-token KL.
      drawQuality() {
        const box = this.$refs.qualityCharts;
        if (!box) return;
        box.replaceChildren();
        const rows = this.quality;
        const figure = function (id, label) {
          const element = document.createElement('figure');
          element.className = 'chart small';
          element.id = id;
          const plot = document.createElement('div');
          plot.className = 'svg-plot';
          plot.setAttribute('role', 'img');
          plot.setAttribute('aria-label', label);
          element.appendChild(plot);
          box.appendChild(element);
          return plot;
        };
        const ppl = figure('quality-ppl-chart', 'Bar chart, perplexity change against the source per artifact: ' +
          rows.map(function (row) { return row.short + ' ' + row.increase; }).join(', '));
        window.fp8svg.bars(ppl, {
          title: 'Perplexity change against the source (%)', yLabel: 'change (%)',
          bars: rows.map(function (row, i) { return { label: row.short, value: row.rise, color: i }; }),
        });
        const kl = figure('quality-kl-chart', 'Bar chart, mean per-token KL divergence per artifact: ' +
          rows.map(function (row) { return row.short + ' ' + row.klMean; }).join(', '));
        window.fp8svg.bars(kl, {
          title: 'Mean KL divergence per token (nats)', yLabel: 'KL (nats)',
          bars: rows.map(function (row, i) { return { label: row.short, value: row.entry.kl_mean, color: i }; }),
        });
      },
    };
  }

  window.fp8quality = { mixin: mixin, qualityRows: qualityRows, increase: increase };
})();
