// Charts drawn by uPlot (canvas) from report data; each chart's container carries a text description for
// screen readers, and the same numbers are in a table next to it.
(function () {
  'use strict';

  const COLORS = ['#1d4ed8', '#b91c1c', '#047857', '#b45309', '#6d28d9'];
  const INTEGER_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000];

  function widthOf(element) { return Math.max(element.clientWidth || 0, 320); }

  function draw(element, options, data) {
    if (element._plot) element._plot.destroy();
    element.replaceChildren();
    const plot = new window.uPlot(Object.assign({ width: widthOf(element), height: 260 }, options), data, element);
    element._plot = plot;
    if (!element._resize) {
      element._resize = new ResizeObserver(function () {
        if (element._plot) element._plot.setSize({ width: widthOf(element), height: element._plot.height });
      });
      element._resize.observe(element);
    }
    return plot;
  }

  function integerAxis(label, names) {
    return {
      label: label, incrs: INTEGER_STEPS,
      values: function (u, splits) {
        return splits.map(function (v) { return Number.isInteger(v) ? (names ? (names[v] !== undefined ? names[v] : '') : v) : ''; });
      },
    };
  }

  // One bar per x position: values in percent, names label the bars.
  function bars(element, spec) {
    const x = spec.names.map(function (_, i) { return i; });
    return draw(element, {
      title: spec.title,
      scales: { x: { time: false, range: [-0.5, Math.max(x.length - 0.5, 0.5)] }, y: { range: [0, 100] } },
      series: [
        { label: spec.xLabel, value: function (u, v) { return v === null ? '' : spec.names[v]; } },
        {
          label: spec.yLabel, stroke: COLORS[0], fill: 'rgba(29, 78, 216, 0.55)', width: 1,
          paths: window.uPlot.paths.bars({ size: [0.85, 40] }), points: { show: false },
          value: function (u, v) { return v === null ? '' : v.toFixed(1) + '%'; },
        },
      ],
      axes: [integerAxis(spec.xLabel, spec.names), { label: spec.yLabel, size: 55 }],
    }, [x, spec.values]);
  }

  // Lines over integer x (layer index or calibration step); log: a log10 y scale (non-positive values left out).
  function lines(element, spec) {
    const x = spec.x;
    const data = [x].concat(spec.series.map(function (s) {
      return s.values.map(function (v) { return spec.log && !(v > 0) ? null : v; });
    }));
    return draw(element, {
      title: spec.title,
      scales: { x: { time: false }, y: spec.log ? { distr: 3 } : {} },
      series: [{ label: spec.xLabel, value: function (u, v) { return v === null ? '' : spec.xName(v); } }].concat(
        spec.series.map(function (s, i) {
          return {
            label: s.label, stroke: COLORS[i % COLORS.length], width: 1.5, points: { show: x.length <= 64 },
            value: function (u, v) { return v === null ? '' : window.fp8table.formatNumber(v); },
          };
        })),
      axes: [integerAxis(spec.xLabel), { label: spec.yLabel, size: 70 }],
    }, data);
  }

  window.fp8charts = { bars: bars, lines: lines };
})();
