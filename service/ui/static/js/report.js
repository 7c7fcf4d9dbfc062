// A finished job's fp8_report.json: overview, warnings, per-layer calibration charts and tables (amax and
// scale per layer; a chosen layer's history over the calibration steps), fused groups, serving selections,
// stage timings and versions. The SQNR, quality, plan and amax swing blocks are fp8analysis's and fp8quality's.
(function () {
  'use strict';

  const fmt = function (v) { return window.fp8table.formatNumber(v); };
  const FORWARD = ['input', 'weight', 'output'];

  function column(steps, slot) {
    return steps.map(function (step) { return step[slot]; });
  }

  function largest(values) {
    let best = null;
    for (const v of values) if (typeof v === 'number' && (best === null || v > best)) best = v;
    return best;
  }

  // The scales a layer's state holds: TE's scale_fwd, or the last step of a dynamic recipe's per-step scales.
  function scalesOf(layer) {
    if (layer.scale_fwd) return layer.scale_fwd;
    if (layer.scale_fwd_per_step && layer.scale_fwd_per_step.length) {
      return layer.scale_fwd_per_step[layer.scale_fwd_per_step.length - 1];
    }
    return null;
  }

  function calibrationRows(layers) {
    return Object.keys(layers).map(function (path, i) {
      const layer = layers[path];
      const steps = layer.amax_forward || [];
      const scales = scalesOf(layer);
      return {
        index: i + 1, path: path, input: largest(column(steps, 0)), weight: largest(column(steps, 1)),
        output: largest(column(steps, 2)), inputScale: scales ? scales[0] : null, weightScale: scales ? scales[1] : null,
      };
    });
  }

  function overviewOf(report) {
    const cal = report.calibration || {};
    const check = cal.te_check || {};
    const pipeline = report.pipeline || {};
    const list = [
      ['Model', report.model],
      ['Backend', report.backend],
      ['Recipe', JSON.stringify(report.recipe)],
      ['Pipeline', (pipeline.mode || '') + (pipeline.reason ? ': ' + pipeline.reason : '') +
        (pipeline.device ? ' (' + pipeline.device + ')' : '')],
      ['Converted modules', fmt((report.converted_modules || []).length)],
      ['Calibration', cal.steps + ' steps of ' + cal.batch_size + ' × ' + cal.seq_len + ' tokens' +
        (cal.backward ? ', with backward passes' : '')],
      ['Calibration data', cal.data_source || ''],
      ['TransformerEngine check', check.ran ? 'ran' + (check.cosine !== undefined ? ', cosine ' + check.cosine : '')
        : 'not run' + (check.reason ? ': ' + check.reason : '')],
    ];
    return list.map(function (pair) { return { label: pair[0], value: pair[1] === undefined ? '' : String(pair[1]) }; });
  }

  function timingsOf(seconds) {
    const stages = Object.keys(seconds || {});
    const total = stages.reduce(function (sum, stage) { return sum + seconds[stage]; }, 0);
    return stages.map(function (stage) {
      const fraction = total ? seconds[stage] / total : 0;
      return { stage: stage, seconds: seconds[stage].toFixed(2), fraction: fraction, share: window.fp8.formatPercent(fraction) };
    });
  }

  const CALIBRATION_COLUMNS = [
    { value: function (r) { return r.index; }, cls: 'num' },
    { value: function (r) { return r.path; }, header: true, cls: 'path' },
    { value: function (r) { return fmt(r.input); }, cls: 'num' },
    { value: function (r) { return fmt(r.weight); }, cls: 'num' },
    { value: function (r) { return fmt(r.output); }, cls: 'num' },
    { value: function (r) { return fmt(r.inputScale); }, cls: 'num' },
    { value: function (r) { return fmt(r.weightScale); }, cls: 'num' },
  ];

  // State and methods for the job page's report section (refs: amaxChart, scaleChart, historyChart,
  // historyRows, calibrationRows).
  function mixin() {
    let layers = {};
    let rows = [];
    return {
      overview: [],
      warnings: [],
      timings: [],
      versions: [],
      fusedGroups: [],
      serving: [],
      layerPaths: [],
      selectedLayer: '',
      hasScales: false,
      calibrationText: '',
      amaxLabel: '',
      scaleLabel: '',
      historyLabel: '',
      historyCaption: '',
      historyColumns: [],

      showReport(report) {
        const cal = report.calibration || {};
        layers = cal.layers || {};
        rows = calibrationRows(layers);
        this.overview = overviewOf(report);
        this.warnings = report.warnings || [];
        this.timings = timingsOf(report.stage_seconds);
        const versions = report.versions || {};
        this.versions = Object.keys(versions).map(function (name) { return { name: name, version: versions[name] }; });
        this.fusedGroups = ((report.analysis || {}).fused_groups || []).map(function (group) {
          const kept = group.members.filter(function (m) { return group.eligible_members.indexOf(m) < 0; });
          return {
            name: group.name, partly: group.partly_eligible,
            fp8: group.eligible_members.length + ' of ' + group.members.length,
            kept: kept.join(', ') || '—',
          };
        });
        const serving = report.serving || {};
        this.serving = Object.keys(serving).map(function (name) {
          const plan = serving[name];
          const skipped = Object.keys(plan.skipped || {});
          const stats = plan.layer_stats || {};
          const sqnr = Object.keys(stats).map(function (path) {
            const db = stats[path].sqnr_db ? stats[path].sqnr_db.weight : stats[path].weight_sqnr_db; // older reports
            return { path: path, db: db, cost: stats[path].ue8m0_cost_db };
          }).filter(function (row) { return row.db !== null && row.db !== undefined; })
            .sort(function (a, b) { return a.db - b.db; });
          const audit = plan.load_audit;
          const kv = plan.kv_cache;
          const kept = skipped.map(function (path) { return path + ' (' + plan.skipped[path] + ')'; }).join('; ') || '—';
          return {
            format: name, quantized: (plan.quantized || []).length, skipped: kept,
            skippedShort: skipped.length ? skipped.length + ' layers (hover for which)' : '—',
            loadsIn: window.fp8requantize.loadsInRows(plan.loads_in),
            sqnr: sqnr.length ? sqnr[0].db.toFixed(1) + ' / ' + sqnr[Math.floor(sqnr.length / 2)].db.toFixed(1) : '—',
            layers: sqnr.map(function (row) {
              return row.path + ': ' + row.db.toFixed(2) + ' dB' +
                (row.cost !== undefined ? ' (UE8M0 costs ' + row.cost.toFixed(2) + ' dB)' : '');
            }),
            kv: kv ? Object.keys(kv.layers || {}).length + ' layers' : '—',
            audit: !audit ? '—' : (!audit.audited ? 'not audited' :
              (audit.ok ? 'ok (' + audit.tensors_checked + ' tensors)' : audit.problems.length + ' problem(s)')),
          };
        });
        this.layerPaths = rows.map(function (row) { return row.path; });
        this.hasScales = rows.some(function (row) { return row.inputScale !== null; });
        this.calibrationText = rows.length + ' layers calibrated; slots ' + (cal.slots_forward || FORWARD).join(', ') + '.';
        const wanted = new URLSearchParams(window.location.search).get('layer');
        this.selectedLayer = this.layerPaths.indexOf(wanted) >= 0 ? wanted : (this.layerPaths[0] || '');
        if (report.analysis) this.showAnalysis(report.analysis);
        this.showAccuracy(report);
        const self = this;
        this.$nextTick(function () { self.drawLayers(); self.drawHistory(); });
      },

      drawLayers() {
        if (!rows.length) return;
        const x = rows.map(function (_, i) { return i; });
        const name = function (i) { return rows[i] ? rows[i].path : ''; };
        window.fp8table.render(this.$refs.calibrationRows, rows, CALIBRATION_COLUMNS, function (row) {
          return { 'data-path': row.path };
        });
        this.amaxLabel = 'Line chart: input, weight and output amax of ' + rows.length +
          ' calibrated layers in model order, log scale; the table "Amax and scale per layer" has the numbers.';
        window.fp8charts.lines(this.$refs.amaxChart, {
          title: 'Amax per layer', x: x, xName: name, xLabel: 'layer (model order)', yLabel: 'amax', log: true,
          series: [
            { label: 'input amax', values: rows.map(function (r) { return r.input; }) },
            { label: 'weight amax', values: rows.map(function (r) { return r.weight; }) },
            { label: 'output amax', values: rows.map(function (r) { return r.output; }) },
          ],
        });
        if (!this.hasScales) return;
        this.scaleLabel = 'Line chart: input and weight scale of ' + rows.length + ' layers, log scale.';
        window.fp8charts.lines(this.$refs.scaleChart, {
          title: 'Scale per layer', x: x, xName: name, xLabel: 'layer (model order)', yLabel: 'scale', log: true,
          series: [
            { label: 'input scale', values: rows.map(function (r) { return r.inputScale; }) },
            { label: 'weight scale', values: rows.map(function (r) { return r.weightScale; }) },
          ],
        });
      },

      drawHistory() {
        const layer = layers[this.selectedLayer];
        if (!layer) return;
        const forward = layer.amax_forward || [];
        const steps = forward.map(function (_, i) { return i + 1; });
        const series = FORWARD.map(function (slot, i) { return { label: slot + ' amax', values: column(forward, i) }; });
        (layer.amax_backward ? ['grad_output', 'grad_input'] : []).forEach(function (slot, i) {
          series.push({ label: slot + ' amax', values: column(layer.amax_backward, i) });
        });
        if (layer.scale_fwd_per_step) {
          series.push({ label: 'input scale', values: column(layer.scale_fwd_per_step, 0) });
        }
        const path = this.selectedLayer;
        this.historyLabel = 'Line chart: amax of ' + path + ' at each of ' + steps.length + ' calibration steps, log scale.';
        this.historyCaption = path + ': amax per calibration step';
        this.historyColumns = ['step'].concat(series.map(function (s) { return s.label; }));
        window.fp8charts.lines(this.$refs.historyChart, {
          title: path, x: steps, xName: function (v) { return 'step ' + v; }, xLabel: 'calibration step',
          yLabel: 'amax', log: true, series: series,
        });
        const stepRows = steps.map(function (step, i) {
          return { step: step, values: series.map(function (s) { return s.values[i]; }) };
        });
        const columns = [{ value: function (r) { return r.step; }, header: true, cls: 'num' }].concat(
          series.map(function (_, k) { return { value: function (r) { return fmt(r.values[k]); }, cls: 'num' }; }));
        window.fp8table.render(this.$refs.historyRows, stepRows, columns);
        const url = new URL(window.location.href);
        url.searchParams.set('layer', path);
        window.history.replaceState(null, '', url);
      },
    };
  }

  window.fp8report = { mixin: mixin };
})();
