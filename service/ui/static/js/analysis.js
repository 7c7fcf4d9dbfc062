// The eligibility report (POST /v1/analyze, and the analysis inside fp8_report.json): totals, MoE blocks, a chart
// of the FP8 share per layer across the model's depth, and the sortable, filterable table of every Linear.
(function () {
  'use strict';

  const fmt = function (v) { return window.fp8table.formatNumber(v); };

  // The first number segment of a path is its layer in the stack: model.layers.12.mlp.up_proj -> 12.
  function blockOf(path) {
    const match = /(?:^|\.)(\d+)(?:\.|$)/.exec(path);
    return match ? Number(match[1]) : null;
  }

  function rowsOf(report) {
    return report.layers.map(function (layer, index) {
      return {
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
        const self = this;
        this.$nextTick(function () {
          self.drawShareChart();
          self.renderRows();
          void self.$refs.analysisRows.offsetHeight; // include the layout in the time
          self.renderMs = Math.round(performance.now() - started);
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
          return { 'data-path': row.path, class: row.eligible ? 'fp8' : 'kept' };
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
