// A requantize job's requantize_report.json (converters/modelfree/driver.py): the target format, what was
// quantized, each shard's share, each Linear weight with its reasons and weight SQNR, and where the export loads.
(function () {
  'use strict';

  const fmt = function (v) { return window.fp8table.formatNumber(v); };

  function factsOf(report) {
    const layers = report.layers || [];
    const quantized = Object.keys(report.quantized || {});
    const options = report.options || {};
    const list = [
      ['Format', report.format],
      ['Model type', report.model_type || '—'],
      ['Scale dtype', report.scale_dtype],
      ['Source', report.source_quantization ? 'quantized (' + JSON.stringify(report.source_quantization) + ')' : 'not quantized'],
      ['Quantized', quantized.length + ' of ' + layers.length + ' Linear weights'],
      ['Shards', fmt((report.shards || []).length)],
      ['Dequantized / dropped', (report.dequantized || []).length + ' / ' + (report.dropped || []).length],
      ['Options', 'include ' + ((options.include || []).join(', ') || 'all') + '; exclude ' +
        ((options.exclude || []).join(', ') || 'none') + '; first and last Linear ' + (options.skip_first_last ? 'kept' : 'converted')],
    ];
    return list.map(function (pair) { return { label: pair[0], value: String(pair[1] === undefined ? '' : pair[1]) }; });
  }

  function sqnrOf(stats) {
    if (!stats) return null;
    if (typeof stats.weight_sqnr_db === 'number') return stats.weight_sqnr_db;
    return stats.sqnr_db && typeof stats.sqnr_db.weight === 'number' ? stats.sqnr_db.weight : null;
  }

  function layerRows(report) {
    const quantized = report.quantized || {};
    const stats = report.layer_stats || {};
    return (report.layers || []).map(function (layer) {
      const sqnr = sqnrOf(stats[layer.module]);
      return {
        path: layer.module, shard: layer.shard, shape: (layer.in_features || '?') + ' → ' + (layer.out_features || '?'),
        quantized: layer.key in quantized, sqnr: sqnr, sqnrText: sqnr === null ? '—' : sqnr.toFixed(2),
        reasons: (layer.reasons || []).join(', ') || '—',
      };
    });
  }

  function shardRows(report) {
    const perShard = report.per_shard || {};
    return (report.shards || Object.keys(perShard)).map(function (shard) {
      const entry = perShard[shard] || {};
      return {
        shard: shard, parts: window.fp8.pathParts(shard), converted: (entry.converted || []).length,
        kept: Object.keys(entry.kept || {}).length, bytes: window.fp8.formatBytes(entry.bytes),
      };
    });
  }

  // {consumer, status, note} cells (converters/serving/loads_in.py) as rows: "not loaded" is marked as an error,
  // a consumer that loads the export only by dequantizing it as a warning.
  function loadsInRows(cells) {
    return (cells || []).map(function (cell) {
      const status = String(cell.status || '');
      const level = status.startsWith('not') ? 'not-loaded' : status === 'loads' ? '' : 'dequantized';
      return { consumer: cell.consumer, status: status, note: cell.note || '', level: level, bad: level === 'not-loaded' };
    });
  }

  function mixin() {
    return {
      requantizeReady: false,
      rqFacts: [],
      rqShards: [],
      rqLayers: [],
      rqWorst: [],
      rqLoadsIn: [],
      rqWarnings: [],

      showRequantize(report) {
        this.rqFacts = factsOf(report);
        this.rqShards = shardRows(report);
        this.rqLayers = layerRows(report);
        this.rqWorst = this.rqLayers.filter(function (row) { return row.sqnr !== null; })
          .sort(function (a, b) { return a.sqnr - b.sqnr; }).slice(0, 5);
        this.rqLoadsIn = loadsInRows(report.loads_in);
        this.rqWarnings = report.warnings || [];
        this.requantizeReady = true;
      },
    };
  }

  window.fp8requantize = { mixin: mixin, loadsInRows: loadsInRows };
})();
