// Table bodies built from DOM nodes with textContent (never HTML): fast for thousands of cells, and no string
// from a report can turn into markup.
(function () {
  'use strict';

  const collator = new Intl.Collator(undefined, { numeric: true, sensitivity: 'base' });

  // columns: [{value(row) -> string | number | Node, header?: true (a row header), cls?: string}]
  function render(tbody, rows, columns, rowAttributes) {
    const fragment = document.createDocumentFragment();
    for (const row of rows) {
      const tr = document.createElement('tr');
      if (rowAttributes) {
        const attributes = rowAttributes(row);
        for (const name in attributes) tr.setAttribute(name, attributes[name]);
      }
      for (const column of columns) {
        const cell = document.createElement(column.header ? 'th' : 'td');
        if (column.header) cell.scope = 'row';
        if (column.cls) cell.className = column.cls;
        const value = column.value(row);
        if (value instanceof Node) cell.appendChild(value);
        else cell.textContent = value === null || value === undefined ? '' : String(value);
        tr.appendChild(cell);
      }
      fragment.appendChild(tr);
    }
    tbody.replaceChildren(fragment);
  }

  // Compares two cell values: numbers as numbers, strings naturally (layers.2 before layers.10), missing ones last.
  function compare(a, b) {
    if (typeof a === 'number' && typeof b === 'number') return a - b;
    const aMissing = a === null || a === undefined;
    const bMissing = b === null || b === undefined;
    if (aMissing || bMissing) return (aMissing ? 1 : 0) - (bMissing ? 1 : 0); // a missing value sorts after any
    if (typeof a === 'boolean' && typeof b === 'boolean') return (a ? 1 : 0) - (b ? 1 : 0);
    return collator.compare(a === null || a === undefined ? '' : String(a), b === null || b === undefined ? '' : String(b));
  }

  function sortRows(rows, key, direction) {
    const sorted = rows.slice();
    sorted.sort(function (x, y) {
      const missing = (x[key] === null || x[key] === undefined ? 1 : 0) - (y[key] === null || y[key] === undefined ? 1 : 0);
      return missing || direction * compare(x[key], y[key]) || x.index - y.index; // missing values last either way
    });
    return sorted;
  }

  function formatNumber(value) {
    if (value === null || value === undefined || value === '') return '';
    if (typeof value !== 'number') return String(value);
    if (Number.isInteger(value)) return value.toLocaleString('en-US');
    const magnitude = Math.abs(value);
    return magnitude !== 0 && (magnitude < 1e-3 || magnitude >= 1e6) ? value.toExponential(3) : value.toPrecision(5);
  }

  window.fp8table = { render: render, compare: compare, sortRows: sortRows, formatNumber: formatNumber };
})();
