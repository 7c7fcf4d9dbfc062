// compare_recipes of POST /v1/analyze: one row per recipe (formats, lowest and median output SQNR, its worst layer,
// and the end-to-end quality columns when the answer has them), a chart of every layer's output SQNR under each
// recipe (points lead to the layer's row), and the per-layer table.
(function () {
  'use strict';

  const fmt = function (v) { return window.fp8table.formatNumber(v); };

  function fixed(value) { return typeof value === 'number' ? value.toFixed(3) : '—'; }

  function outputOf(layer, label) {
    const entry = (layer.sqnr_db || {})[label];
    return entry && typeof entry.output === 'number' ? entry.output : null;
  }

  // A recipe's quality figures: on the entry itself or under entry.quality (null when the answer has none).
  function qualityOf(entry) {
    const q = entry.quality && typeof entry.quality === 'object' ? entry.quality : entry;
    return ['perplexity', 'kl_mean', 'kl_max', 'top1_agreement'].some(function (k) { return typeof q[k] === 'number'; }) ? q : null;
  }

  function summaryRow(entry, layers) {
    const label = entry.label;
    const measured = layers.map(function (layer) { return { path: layer.path, db: outputOf(layer, label) }; })
      .filter(function (row) { return row.db !== null; }).sort(function (a, b) { return a.db - b.db; });
    const q = qualityOf(entry);
    const scales = entry.scale_rule ? Object.keys(entry.scale_rule).map(function (k) { return k + ' ' + entry.scale_rule[k]; }).join(', ') : '';
    return {
      label: label, weightFormat: entry.weight_format || '', inputFormat: entry.input_format || '',
      scales: scales + (entry.delayed ? ' (delayed)' : ''),
      lowest: measured.length ? measured[0].db.toFixed(2) : '—',
      median: measured.length ? measured[Math.floor(measured.length / 2)].db.toFixed(2) : '—',
      worst: measured.length ? measured[0].path : '—',
      worstHref: measured.length ? '#' + window.fp8svg.rowId('cmp', measured[0].path) : '#comparison-table',
      quality: q,
      perplexity: q ? fixed(q.perplexity) + (typeof q.perplexity_reference === 'number' ? ' (' + fixed(q.perplexity_reference) + ')' : '') : '—',
      kl: q ? fmt(q.kl_mean) + ' / ' + fmt(q.kl_max) : '—',
      top1: q && typeof q.top1_agreement === 'number' ? window.fp8.formatPercent(q.top1_agreement) : '—',
    };
  }

  function mixin() {
    return {
      compared: [],
      comparisonText: '',
      comparisonLabel: '',
      hasComparedQuality: false,
      comparedQualityText: '',

      showComparison(report) {
        const comparison = report.comparison;
        const layers = comparison ? comparison.layers || [] : [];
        this.compared = comparison ? (comparison.recipes || []).map(function (entry) { return summaryRow(entry, layers); }) : [];
        this.hasComparedQuality = this.compared.some(function (row) { return row.quality !== null; });
        const quality = report.quality || {};
        if (this.hasComparedQuality) {
          this.comparedQualityText = 'Perplexity (the source\'s in brackets), mean and largest per-token KL divergence ' +
            'and top-1 agreement with the source, on held-out texts (never the calibration batches).';
        } else if (quality.reason) {
          this.comparedQualityText = 'No end-to-end quality columns: ' + quality.reason;
        } else {
          this.comparedQualityText = 'No end-to-end quality columns (perplexity, KL, top-1) in this answer: this ' +
            'server\'s compare_recipes measures the per-layer SQNR only.';
        }
        if (!this.compared.length) return;
        this.comparisonText = this.compared.length + ' recipes, ' + layers.length + ' layers measured from one ' +
          'calibration (' + ((report.calibration || {}).steps || '?') + ' steps). SQNR in dB: higher is better; ' +
          'every 6 dB is one bit.';
        const labels = this.compared.map(function (row) { return row.label; });
        const self = this;
        this.$nextTick(function () { self.drawComparison(labels, layers); });
      },

      drawComparison(labels, layers) {
        const columns = [
          { value: function (r) { return r.index; }, cls: 'num' },
          { value: function (r) { return r.path; }, header: true, cls: 'path' },
        ].concat(labels.map(function (label) {
          return { value: function (r) { const v = outputOf(r.layer, label); return v === null ? '' : v.toFixed(2); }, cls: 'num' };
        }));
        const rows = layers.map(function (layer, i) { return { index: i + 1, path: layer.path, layer: layer }; });
        window.fp8table.render(this.$refs.comparisonRows, rows, columns, function (row) {
          return { id: window.fp8svg.rowId('cmp', row.path), 'data-path': row.path };
        });
        this.comparisonLabel = 'Line chart: output SQNR of ' + layers.length + ' layers under ' + labels.join(', ') +
          '; the table below has the numbers.';
        window.fp8svg.layers(this.$refs.comparisonChart, {
          title: 'Output SQNR per layer and recipe', yLabel: 'SQNR (dB)',
          names: layers.map(function (layer) { return layer.path; }),
          hrefs: layers.map(function (layer) { return '#' + window.fp8svg.rowId('cmp', layer.path); }),
          series: labels.map(function (label) {
            return { label: label, values: layers.map(function (layer) { return outputOf(layer, label); }) };
          }),
        });
      },
    };
  }

  window.fp8compare = { mixin: mixin, qualityOf: qualityOf };
})();
