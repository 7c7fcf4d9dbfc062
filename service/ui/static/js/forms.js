// Form errors: an API error's `field` (a dotted path such as recipe.amax_history_len or include[2]) is shown
// next to the form field that carries that path in its data-field, and read out by screen readers.
(function () {
  'use strict';

  class LocalError extends Error {
    constructor(field, message) { super(message); this.field = field; }
  }

  // State and methods for a component on a <form> whose fields carry data-field="<API path>".
  // redirect(key) may send a path elsewhere (e.g. recipe.* to the YAML box when the recipe came from YAML).
  function mixin(redirect) {
    let fields = new Set();
    return {
      errors: {},
      summary: '',
      status: '',
      busy: false,

      collectFields(form) {
        fields = new Set(Array.from(form.querySelectorAll('[data-field]'), function (el) { return el.dataset.field; }));
      },

      invalid(field) { return Boolean(this.errors[field]); },
      errorFor(field) { return this.errors[field] || ''; },

      fieldFor(path) {
        if (!path) return null;
        let key = path.replace(/\[\d+\]/g, '');
        if (redirect) key = redirect.call(this, key);
        while (key) {
          if (fields.has(key)) return key;
          const dot = key.lastIndexOf('.');
          if (dot < 0) return null;
          key = key.slice(0, dot);
        }
        return null;
      },

      clearErrors() {
        this.errors = {};
        this.summary = '';
      },

      // Shows the error by its field (and in the summary), then moves the focus to that field.
      showError(err, form) {
        const field = this.fieldFor(err.field);
        const prefix = err.field ? err.field + ': ' : '';
        const named = Boolean(prefix) && err.message.startsWith(prefix);
        const errors = {};
        // next to its own field the message needs no path; next to an enclosing one (include for include[2]) it does
        if (field) errors[field] = named && field === err.field ? err.message.slice(prefix.length) : err.message;
        this.errors = errors;
        this.summary = named ? err.message : prefix + err.message;
        this.status = '';
        this.$nextTick(function () {
          // several recipes share option names (recipe.fp8_format, ...): the field is the one on show
          const target = field && Array.from(form.querySelectorAll('[data-field="' + field + '"] :is(input, select, textarea)'))
            .find(function (el) { return el.offsetParent !== null; });
          (target || form.querySelector('.error-summary')).focus();
        });
      },

      // A number field: undefined when empty (the API's default applies), else the number as typed.
      numberField(form, name) {
        const input = form.elements.namedItem(name);
        if (input.validity.badInput) throw new LocalError(name, 'Enter a whole number.');
        return input.value.trim() === '' ? undefined : Number(input.value);
      },
    };
  }

  function lines(text) {
    return text.split('\n').map(function (line) { return line.trim(); }).filter(Boolean);
  }

  window.fp8forms = { mixin: mixin, LocalError: LocalError, lines: lines };
})();
