// Analyze page: POST /v1/analyze, then the eligibility report (fp8analysis) below the form.
(function () {
  'use strict';

  document.addEventListener('alpine:init', function () {
    window.Alpine.data('analyzePage', function () {
      return Object.assign(window.fp8forms.mixin(), window.fp8analysis.mixin(), {
        backend: 'te',
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

        async submit() {
          if (this.busy) return;
          const form = this.form();
          this.clearErrors();
          this.busy = true;
          this.status = 'Analyzing…';
          const body = {
            model: form.elements.namedItem('model').value.trim(),
            backend: this.backend,
            include: window.fp8forms.lines(form.elements.namedItem('include').value),
            exclude: window.fp8forms.lines(form.elements.namedItem('exclude').value),
            skip_first_last: form.elements.namedItem('skip_first_last').checked,
            convert_router_gates: form.elements.namedItem('convert_router_gates').checked,
          };
          const started = performance.now();
          try {
            const report = await window.fp8.request('POST', '/v1/analyze', { body: body });
            this.requestMs = Math.round(performance.now() - started);
            this.status = 'Analyzed ' + report.layers.length + ' layers.';
            const url = new URL(window.location.href);
            url.searchParams.set('model', body.model);
            window.history.replaceState(null, '', url);
            this.showAnalysis(report);
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
