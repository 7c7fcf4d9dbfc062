// Analyze page: POST /v1/analyze (with a recipe, a short calibration and recipes to compare when asked), then the
// recipes side by side (fp8compare) and the eligibility report (fp8analysis) below the form.
(function () {
  'use strict';

  document.addEventListener('alpine:init', function () {
    window.Alpine.data('analyzePage', function () {
      const LocalError = window.fp8forms.LocalError;
      return Object.assign(window.fp8forms.mixin(), window.fp8analysis.mixin(), window.fp8compare.mixin(), {
        backend: 'te',
        recipeName: '',
        requestMs: null,

        form() { return document.getElementById('analyze-form'); },

        init() {
          this.collectFields(this.form());
          const model = new URLSearchParams(window.location.search).get('model');
          if (model) {
            this.form().elements.namedItem('model').value = model;
            this.submit();
          }
        },

        // The request: a named recipe replaces the backend; calibration only when asked (compare_recipes and
        // min_sqnr_db imply one on the server).
        body(form) {
          const body = {
            model: form.elements.namedItem('model').value.trim(),
            include: window.fp8forms.lines(form.elements.namedItem('include').value),
            exclude: window.fp8forms.lines(form.elements.namedItem('exclude').value),
            skip_first_last: form.elements.namedItem('skip_first_last').checked,
            convert_router_gates: form.elements.namedItem('convert_router_gates').checked,
          };
          if (this.recipeName) body.recipe = JSON.parse(form.elements.namedItem('recipe').selectedOptions[0].dataset.recipe);
          else body.backend = this.backend;
          const compare = Array.from(form.querySelectorAll('input[name="compare_recipes"]:checked'), function (box) { return box.value; });
          if (compare.length) body.compare_recipes = compare;
          const minimum = form.elements.namedItem('min_sqnr_db');
          if (minimum.validity.badInput) throw new LocalError('min_sqnr_db', 'Enter a number of dB.');
          if (minimum.value.trim() !== '') body.min_sqnr_db = Number(minimum.value);
          if (form.elements.namedItem('calibrate').checked || compare.length || body.min_sqnr_db !== undefined) {
            body.calibration = { steps: this.numberField(form, 'calibration.steps') };
          }
          return JSON.parse(JSON.stringify(body)); // drops the numbers left empty (undefined)
        },

        async submit() {
          if (this.busy) return;
          const form = this.form();
          this.clearErrors();
          this.busy = true;
          this.status = 'Analyzing…';
          const started = performance.now();
          let body = null;
          try {
            body = this.body(form);
            const report = await window.fp8.request('POST', '/v1/analyze', { body: body });
            this.requestMs = Math.round(performance.now() - started);
            this.status = 'Analyzed ' + report.layers.length + ' layers.';
            const url = new URL(window.location.href);
            url.searchParams.set('model', body.model);
            window.history.replaceState(null, '', url);
            this.showAnalysis(report);
            this.showComparison(report);
          } catch (err) {
            this.showError(err, form);
          } finally {
            this.busy = false;
          }
        },
      });
    });
  });
})();
