// Small charts drawn as inline SVG, no library: used where a point must lead somewhere (each point is a link to
// its row in a table, "#<row id>"), which uPlot's canvas cannot do. Text goes in through textContent only, so no
// string from a report can become markup; colours are SVG attributes, not inline styles (the CSP forbids those).
(function () {
  'use strict';

  const NS = 'http://www.w3.org/2000/svg';
  const COLORS = ['#b91c1c', '#1d4ed8', '#047857', '#b45309', '#6d28d9', '#0e7490', '#be185d', '#4d7c0f'];
  const HEIGHT = 260;
  const PAD = { left: 64, right: 16, top: 34, bottom: 40 };
  //: above this many points, the points leave the tab order (the table beside the chart has the same links)
  const MAX_FOCUSABLE = 120;

  function node(name, attributes, parent) {
    const element = document.createElementNS(NS, name);
    for (const key in attributes) element.setAttribute(key, attributes[key]);
    if (parent) parent.appendChild(element);
    return element;
  }

  function text(parent, x, y, value, attributes) {
    const element = node('text', Object.assign({ x: x, y: y }, attributes || {}), parent);
    element.textContent = value;
    return element;
  }

  // About five round steps between low and high (1, 2 or 5 times a power of ten).
  function ticks(low, high) {
    if (!(high > low)) return [low];
    const raw = (high - low) / 5;
    const power = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map(function (m) { return m * power; }).find(function (s) { return s >= raw; });
    const list = [];
    for (let v = Math.ceil(low / step) * step; v <= high + step * 1e-9; v += step) list.push(Number(v.toPrecision(12)));
    return list;
  }

  // Drawn at the container's width in pixels (text keeps its size); a container not laid out yet (hidden) takes
  // its parent's, and CSS lets the chart shrink with the window (max-width: 100%).
  function svgFor(container, title) {
    const parent = container.parentElement;
    const width = Math.min(Math.max(container.clientWidth || (parent && parent.clientWidth) || 800, 300), 1100);
    container.replaceChildren();
    const svg = node('svg', { viewBox: '0 0 ' + width + ' ' + HEIGHT, width: width, height: HEIGHT, class: 'svg-chart' },
      container);
    text(svg, width / 2, 18, title, { 'text-anchor': 'middle', class: 'chart-title' });
    return { svg: svg, width: width };
  }

  function yAxis(svg, width, low, high, label) {
    const plotHeight = HEIGHT - PAD.top - PAD.bottom;
    const y = function (v) { return PAD.top + plotHeight * (1 - (v - low) / (high - low || 1)); };
    for (const v of ticks(low, high)) {
      node('line', { x1: PAD.left, x2: width - PAD.right, y1: y(v), y2: y(v), class: 'grid' }, svg);
      text(svg, PAD.left - 6, y(v) + 4, String(v), { 'text-anchor': 'end', class: 'tick' }); // round already
    }
    text(svg, 14, PAD.top + plotHeight / 2, label,
      { transform: 'rotate(-90 14 ' + (PAD.top + plotHeight / 2) + ')', 'text-anchor': 'middle', class: 'axis-label' });
    return y;
  }

  function legend(svg, width, labels) {
    let x = PAD.left;
    labels.forEach(function (label, i) {
      node('rect', { x: x, y: HEIGHT - 14, width: 10, height: 10, fill: COLORS[i % COLORS.length] }, svg);
      const t = text(svg, x + 14, HEIGHT - 5, label, { class: 'legend' });
      x += 24 + 7 * label.length;
      void t;
    });
  }

  // Lines over the layers in model order. spec: {title, names: [row name], hrefs: [link of each x], yLabel,
  // series: [{label, values (null: no point)}], threshold?: {value, label}, numbers?: [axis label of each x, default
  // 1..n]}. Returns the number of points drawn.
  function layers(container, spec) {
    const chart = svgFor(container, spec.title);
    const svg = chart.svg;
    const all = [];
    spec.series.forEach(function (s) { s.values.forEach(function (v) { if (typeof v === 'number') all.push(v); }); });
    if (spec.threshold) all.push(spec.threshold.value);
    if (!all.length) { text(svg, chart.width / 2, HEIGHT / 2, 'No values.', { 'text-anchor': 'middle' }); return 0; }
    let low = Math.min.apply(null, all);
    let high = Math.max.apply(null, all);
    const margin = (high - low) * 0.08 || Math.abs(high) * 0.05 || 1;
    low -= margin;
    high += margin;
    const y = yAxis(svg, chart.width, low, high, spec.yLabel);
    const count = spec.names.length;
    const plotWidth = chart.width - PAD.left - PAD.right;
    const x = function (i) { return PAD.left + (count > 1 ? (plotWidth * i) / (count - 1) : plotWidth / 2); };
    const every = Math.max(1, Math.ceil(count / 16));
    for (let i = 0; i < count; i += every) {
      text(svg, x(i), HEIGHT - PAD.bottom + 14, String(spec.numbers ? spec.numbers[i] : i + 1),
        { 'text-anchor': 'middle', class: 'tick' });
    }
    if (spec.threshold) {
      const ty = y(spec.threshold.value);
      node('line', { x1: PAD.left, x2: chart.width - PAD.right, y1: ty, y2: ty, class: 'threshold' }, svg);
      text(svg, chart.width - PAD.right, ty - 4, spec.threshold.label, { 'text-anchor': 'end', class: 'tick' });
    }
    let drawn = 0;
    const focusable = count * spec.series.length <= MAX_FOCUSABLE;
    spec.series.forEach(function (s, k) {
      const color = COLORS[k % COLORS.length];
      const coordinates = [];
      s.values.forEach(function (v, i) { if (typeof v === 'number') coordinates.push(x(i) + ',' + y(v)); });
      node('polyline', { points: coordinates.join(' '), fill: 'none', stroke: color, 'stroke-width': 1.5 }, svg);
      s.values.forEach(function (v, i) {
        if (typeof v !== 'number') return;
        const description = spec.names[i] + ': ' + s.label + ' ' + window.fp8table.formatNumber(v);
        const link = node('a', { href: spec.hrefs[i], 'aria-label': description, class: 'point' }, svg);
        if (!focusable) link.setAttribute('tabindex', '-1');
        const dot = node('circle', { cx: x(i), cy: y(v), r: 3.5, fill: color, 'data-name': spec.names[i] }, link);
        node('title', {}, dot).textContent = description;
        drawn += 1;
      });
    });
    legend(svg, chart.width, spec.series.map(function (s) { return s.label; }));
    return drawn;
  }

  // Bars from zero, up or down (a change may be negative): the axis spans zero and every value, so small
  // differences plotted as changes stay visible. spec: {title, yLabel, bars: [{label, value, color?: index}]}.
  function bars(container, spec) {
    const chart = svgFor(container, spec.title);
    const svg = chart.svg;
    const values = spec.bars.map(function (b) { return b.value; }).filter(function (v) { return typeof v === 'number'; });
    if (!values.length) { text(svg, chart.width / 2, HEIGHT / 2, 'No values.', { 'text-anchor': 'middle' }); return; }
    const top = Math.max.apply(null, values.concat([0]));
    const bottom = Math.min.apply(null, values.concat([0]));
    const span = top - bottom || Math.abs(top) || 1;
    const high = top + span * 0.12;
    const low = bottom < 0 ? bottom - span * 0.12 : 0;
    const y = yAxis(svg, chart.width, low, high, spec.yLabel);
    const slot = (chart.width - PAD.left - PAD.right) / spec.bars.length;
    spec.bars.forEach(function (bar, i) {
      const left = PAD.left + slot * i + slot * 0.15;
      text(svg, left + slot * 0.35, HEIGHT - PAD.bottom + 14, bar.label, { 'text-anchor': 'middle', class: 'tick' });
      if (typeof bar.value !== 'number') return;
      const rect = node('rect', {
        x: left, width: slot * 0.7, y: Math.min(y(bar.value), y(0)), height: Math.max(Math.abs(y(0) - y(bar.value)), 0.5),
        fill: COLORS[(bar.color || 0) % COLORS.length], class: 'bar', 'data-label': bar.label,
      }, svg);
      node('title', {}, rect).textContent = bar.label + ': ' + window.fp8table.formatNumber(bar.value);
      text(svg, left + slot * 0.35, bar.value < 0 ? y(bar.value) + 12 : y(bar.value) - 4, window.fp8table.formatNumber(bar.value),
        { 'text-anchor': 'middle', class: 'tick' });
    });
  }

  // A row id for a layer path: "<prefix>-<path>" (paths hold only characters an id and a fragment take as they are).
  function rowId(prefix, path) { return prefix + '-' + path; }

  window.fp8svg = { layers: layers, bars: bars, rowId: rowId, ticks: ticks };
})();
