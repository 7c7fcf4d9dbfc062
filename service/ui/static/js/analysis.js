// The eligibility report (POST /v1/analyze, and the analysis inside fp8_report.json): totals, MoE blocks, a chart
// of the FP8 share per layer across the model's depth, each measured layer's SQNR across the depth (every point a
// link to the layer's row) with the worst layers listed, and the sortable, filterable table of every Linear.
(function () {
  'use strict';

  const fmt = function (v) { return window.fp8table.formatNumber(v); };

  // The first number segment of a path is its layer in the stack: model.layers.12.mlp.up_proj -> 12.
  function blockOf(path) {
    const match = /(?:^|\.)(\d+)(?:\.|$)/.exec(path);
    return match ? Number(match[1]) : null;
  }

  function sqnrOf(layer, slot) {
    const value = layer.sqnr_db ? layer.sqnr_db[slot] : null;
    return typeof value === 'number' ? value : null;
  }

  function rowsOf(report) {
    return report.layers.map(function (layer, index) {
      return {
        sqnr_output: sqnrOf(layer, 'output'), sqnr_weight: sqnrOf(layer, 'weight'), sqnr_input: sqnrOf(layer, 'input'),
        index: index + 1, path: layer.path, cls: layer.class, in_features: layer.in_features,
        out_features: layer.out_features, parameters: layer.parameters, eligible: layer.eligible,
        reasons: layer.reasons.join(', '), reasonList: layer.reasons, group: layer.group || '',
        expert: layer.expert ? 'expert ' + layer.expert.index + ' ' + layer.expert.gemm : '',
        isExpert: Boolean(layer.expert), block: blockOf(layer.path),
      };
    });
  }

  // FP8 share of the matmul parameters in each numbered layer, in depth order, and what lies outside them.
  function depthShares(rows) {
    const blocks = new Map();
    const outside = [];
    for (const row of rows) {
      if (row.block === null) { outside.push(row); continue; }
      const block = blocks.get(row.block) || { total: 0, fp8: 0 };
      block.total += row.parameters;
      if (row.eligible) block.fp8 += row.parameters;
      blocks.set(row.block, block);
    }
    const order = Array.from(blocks.keys()).sort(function (a, b) { return a - b; });
    return {
      names: order.map(String),
      values: order.map(function (b) { const s = blocks.get(b); return s.total ? (100 * s.fp8) / s.total : 0; }),
      outside: outside.map(function (row) { return row.path + (row.eligible ? ' (FP8)' : ' (kept: ' + row.reasons + ')'); }),
    };
  }

  function totalsList(t) {
    const pct = window.fp8.formatPercent;
    const list = [
      ['Linear layers', fmt(t.linear_layers)],
      ['Eligible for FP8', fmt(t.eligible_layers)],
      ['Kept in high precision', fmt(t.skipped_layers)],
      ['Linear parameters', fmt(t.linear_parameters)],
      ['FP8 parameters', fmt(t.fp8_parameters)],
      ['FP8 share of Linear parameters', pct(t.fp8_share_of_linear_parameters)],
      ['FP8 share of all matmul parameters', pct(t.fp8_share_of_all_matmul_parameters)],
    ];
    if (t.expert_units) {
      list.push(['MoE expert units (eligible)', fmt(t.expert_units) + ' (' + fmt(t.eligible_expert_units) + ')']);
      list.push(['FP8 share of expert parameters', pct(t.fp8_share_of_expert_parameters)]);
    }
    if (t.conv1d_layers) list.push(['Conv1D layers (never swapped)', fmt(t.conv1d_layers)]);
    if (t.weight_bytes !== undefined) {
      list.push(['Weights (' + t.weight_dtype + ')', window.fp8.formatBytes(t.weight_bytes)]);
      list.push(['Weights with FP8 layers at one byte', window.fp8.formatBytes(t.weight_bytes_with_fp8)]);
    }
    list.push(['Partly eligible fused groups', fmt(t.partly_eligible_groups)]);
    return list.map(function (pair) { return { label: pair[0], value: pair[1] }; });
  }

  function reasonOptions(rows) {
    const counts = new Map();
    let eligible = 0;
    for (const row of rows) {
      if (row.eligible) eligible += 1;
      for (const reason of row.reasonList) counts.set(reason, (counts.get(reason) || 0) + 1);
    }
    const options = [
      { value: '', label: 'all layers (' + rows.length + ')' },
      { value: ':eligible', label: 'eligible (' + eligible + ')' },
      { value: ':skipped', label: 'kept in high precision (' + (rows.length - eligible) + ')' },
    ];
    Array.from(counts.keys()).sort().forEach(function (reason) {
      options.push({ value: reason, label: reason + ' (' + counts.get(reason) + ')' });
    });
    return options;
  }

  const COLUMNS = [
    { value: function (r) { return r.index; }, cls: 'num' },
    { value: function (r) { return r.path; }, header: true, cls: 'path' },
    { value: function (r) { return r.cls + (r.expert ? ' · ' + r.expert : ''); } },
    { value: function (r) { return fmt(r.in_features); }, cls: 'num' },
    { value: function (r) { return fmt(r.out_features); }, cls: 'num' },
    { value: function (r) { return fmt(r.parameters); }, cls: 'num' },
    { value: function (r) { return r.eligible ? 'FP8' : 'kept'; } },
    { value: function (r) { return r.sqnr_output === null ? '' : r.sqnr_output.toFixed(2); }, cls: 'num' },
    { value: function (r) { return r.sqnr_weight === null ? '' : r.sqnr_weight.toFixed(2); }, cls: 'num' },
    { value: function (r) { return r.reasons; }, cls: 'reasons' },
    { value: function (r) { return r.group; }, cls: 'path' },
  ];

  // State and methods for a component that shows one report; its template has x-ref="analysisRows" (tbody)
  // and x-ref="shareChart". The rows themselves stay outside Alpine's reactivity: 500+ proxied rows would only
  // slow sorting down.
  function mixin() {
    let rows = [];
    return {
      analysis: null,
      totals: [],
      moe: [],
      reasonChoices: [],
      reasonFilter: '',
      pathFilter: '',
      kindFilter: '',
      hasExperts: false,
      sortKey: 'index',
      sortDirection: 1,
      shownText: '',
      outsideText: '',
      chartLabel: '',
      renderMs: null,
      sortMs: null,
      sqnrMeasured: false,
      sqnrText: '',
      sqnrLabel: '',
      worstLayers: [],

      showAnalysis(report) {
        const started = performance.now();
        rows = rowsOf(report);
        this.analysis = { model_class: report.model_class, rule: report.rule, backend: report.options.backend };
        this.totals = totalsList(report.totals);
        this.moe = (report.moe || []).map(function (block) {
          return Object.assign({}, block, {
            supportedText: block.supported ? 'yes' : 'no: ' + (block.why_not || ''),
            tokensText: block.tokens_per_expert ? block.tokens_per_expert.join(', ') : '',
          });
        });
        this.reasonChoices = reasonOptions(rows);
        this.hasExperts = rows.some(function (row) { return row.isExpert; });
        this.reasonFilter = '';
        this.pathFilter = '';
        this.kindFilter = '';
        this.sortKey = 'index';
        this.sortDirection = 1;
        this.describeSqnr(report);
        const self = this;
        this.$nextTick(function () {
          self.drawShareChart();
          self.drawSqnrChart(report);
          self.renderRows();
          void self.$refs.analysisRows.offsetHeight; // include the layout in the time
          self.renderMs = Math.round(performance.now() - started);
          self.revealLayer(); // an address with "#layer-<path>" opens at that row
        });
      },

      drawShareChart() {
        const shares = depthShares(rows);
        this.outsideText = shares.outside.length ? 'Outside the numbered layers: ' + shares.outside.join('; ') + '.' : '';
        if (!shares.values.length) { this.chartLabel = 'No numbered layers.'; return; }
        const low = Math.min.apply(null, shares.values);
        const high = Math.max.apply(null, shares.values);
        this.chartLabel = 'Bar chart: FP8 share of the matmul parameters in each of ' + shares.values.length +
          ' layers, from ' + low.toFixed(1) + '% to ' + high.toFixed(1) + '%.';
        window.fp8charts.bars(this.$refs.shareChart, {
          title: 'FP8 share per layer', names: shares.names, values: shares.values,
          xLabel: 'layer', yLabel: 'FP8 share (%)',
        });
      },

      // What the SQNR chart and the worst-layer list say: measured layers, or why there are none.
      describeSqnr(report) {
        const measured = rows.filter(function (row) { return row.sqnr_output !== null; });
        const sensitivity = report.sensitivity || {};
        this.sqnrMeasured = measured.length > 0;
        if (!measured.length) {
          this.sqnrText = sensitivity.measured === false
            ? 'Not measured: the SQNR measurement was off for this run' + (sensitivity.reason ? ' (' + sensitivity.reason + ')' : '') + '.'
            : 'No layer has an SQNR here: it is measured during a calibration (a conversion job, or an analysis with ' +
              'a calibration or recipes to compare).';
          this.worstLayers = [];
          return;
        }
        const recipe = sensitivity.recipe ? sensitivity.recipe.label : '';
        const limit = typeof sensitivity.min_sqnr_db === 'number' ? sensitivity.min_sqnr_db : null;
        this.sqnrText = measured.length + ' layers measured' + (recipe ? ' under ' + recipe : '') +
          (limit !== null ? '; layers below ' + limit + ' dB (output) are kept in high precision' : '') + '.';
        this.worstLayers = measured.slice().sort(function (a, b) { return a.sqnr_output - b.sqnr_output; })
          .slice(0, 5).map(function (row) {
            return {
              path: row.path, href: '#' + window.fp8svg.rowId('layer', row.path),
              text: row.sqnr_output.toFixed(2) + ' dB output, ' + (row.sqnr_weight === null ? '—' : row.sqnr_weight.toFixed(2)) +
                ' dB weight, ' + (row.sqnr_input === null ? '—' : row.sqnr_input.toFixed(2)) + ' dB input' +
                (row.eligible ? '' : ' (kept: ' + row.reasons + ')'),
            };
          });
      },

      drawSqnrChart(report) {
        if (!this.sqnrMeasured) return;
        const measured = rows.filter(function (row) { return row.sqnr_output !== null; });
        const sensitivity = report.sensitivity || {};
        const low = Math.min.apply(null, measured.map(function (row) { return row.sqnr_output; }));
        this.sqnrLabel = 'Line chart: output, weight and input SQNR (dB) of ' + measured.length +
          ' layers in model order, lowest output SQNR ' + low.toFixed(2) + ' dB; each point links to its row in the ' +
          'table "Linear layers".';
        window.fp8svg.layers(this.$refs.sqnrChart, {
          title: 'SQNR per layer (higher is better)', yLabel: 'SQNR (dB)',
          names: measured.map(function (row) { return row.path; }),
          numbers: measured.map(function (row) { return row.index; }),
          hrefs: measured.map(function (row) { return '#' + window.fp8svg.rowId('layer', row.path); }),
          series: [
            { label: 'output', values: measured.map(function (row) { return row.sqnr_output; }) },
            { label: 'weight', values: measured.map(function (row) { return row.sqnr_weight; }) },
            { label: 'input', values: measured.map(function (row) { return row.sqnr_input; }) },
          ],
          threshold: typeof sensitivity.min_sqnr_db === 'number'
            ? { value: sensitivity.min_sqnr_db, label: 'min_sqnr_db ' + sensitivity.min_sqnr_db } : null,
        });
      },

      // A link to "#layer-<path>" (a chart point, a worst layer, a plan row): the row may be filtered out, so the
      // filters are cleared first; then the row is marked, scrolled to and focused (CSS :target alone misses a row
      // drawn after the navigation).
      revealLayer() {
        const prefix = '#' + window.fp8svg.rowId('layer', '');
        if (!window.location.hash.startsWith(prefix)) return;
        const id = decodeURIComponent(window.location.hash.slice(1));
        if (!rows.some(function (row) { return window.fp8svg.rowId('layer', row.path) === id; })) return;
        if (!document.getElementById(id)) {
          this.reasonFilter = '';
          this.pathFilter = '';
          this.kindFilter = '';
          this.renderRows();
        }
        const target = document.getElementById(id);
        if (!target) return;
        const folded = target.closest('details'); // the job page folds the layer table
        if (folded) folded.open = true;
        this.$refs.analysisRows.querySelectorAll('tr.linked').forEach(function (tr) { tr.classList.remove('linked'); });
        target.classList.add('linked');
        target.tabIndex = -1;
        target.focus({ preventScroll: true });
        target.scrollIntoView({ block: 'center' });
      },

      visibleRows() {
        const needle = this.pathFilter.trim().toLowerCase();
        const reason = this.reasonFilter;
        const kind = this.kindFilter;
        const picked = rows.filter(function (row) {
          if (needle && row.path.toLowerCase().indexOf(needle) < 0) return false;
          if (kind === 'linear' && row.isExpert) return false;
          if (kind === 'expert' && !row.isExpert) return false;
          if (reason === ':eligible') return row.eligible;
          if (reason === ':skipped') return !row.eligible;
          return !reason || row.reasonList.indexOf(reason) >= 0;
        });
        return window.fp8table.sortRows(picked, this.sortKey, this.sortDirection);
      },

      renderRows() {
        const shown = this.visibleRows();
        window.fp8table.render(this.$refs.analysisRows, shown, COLUMNS, function (row) {
          return { 'data-path': row.path, id: window.fp8svg.rowId('layer', row.path), class: row.eligible ? 'fp8' : 'kept' };
        });
        this.shownText = shown.length + ' of ' + rows.length + ' layers shown, sorted by ' +
          this.sortKey.replace('_', ' ') + (this.sortDirection > 0 ? ' ascending.' : ' descending.');
      },

      sortBy(key) {
        const started = performance.now();
        this.sortDirection = this.sortKey === key ? -this.sortDirection : 1;
        this.sortKey = key;
        this.renderRows();
        void this.$refs.analysisRows.offsetHeight;
        this.sortMs = Math.round(performance.now() - started);
      },

      ariaSort(key) {
        if (this.sortKey !== key) return 'none';
        return this.sortDirection > 0 ? 'ascending' : 'descending';
      },
    };
  }

  window.fp8analysis = { mixin: mixin, blockOf: blockOf };
})();
