// New requantize job: POST /v1/jobs with {model, requantize: {to, measure}, include, exclude, skip_first_last}; each API
// error is shown next to the field its `field` path names (requantize.to, include[0], model).
(function () {
  'use strict';

  function randomKey() {
    const bytes = new Uint8Array(16);
    window.crypto.getRandomValues(bytes);
    return Array.from(bytes, function (b) { return b.toString(16).padStart(2, '0'); }).join('');
  }

  document.addEventListener('alpine:init', function () {
    window.Alpine.data('requantizeForm', function () {
      let idempotencyKey = randomKey(); // a resubmission after a lost answer gives the same job
      return Object.assign(window.fp8forms.mixin(), {
        form() { return document.getElementById('job-form'); },
        init() { this.collectFields(this.form()); },
        value(name) { return this.form().elements.namedItem(name).value; },

        body() {
          const body = { model: this.value('model').trim(), requantize: { to: this.value('requantize.to') } };
          // sent only when off: the API measures by default, and the stored request stays {to} then
          if (!this.form().elements.namedItem('requantize.measure').checked) body.requantize.measure = false;
          const include = window.fp8forms.lines(this.value('include'));
          const exclude = window.fp8forms.lines(this.value('exclude'));
          if (include.length) body.include = include;
          if (exclude.length) body.exclude = exclude;
          body.skip_first_last = this.form().elements.namedItem('skip_first_last').checked;
          return body;
        },

        async submit() {
          if (this.busy) return;
          this.clearErrors();
          this.busy = true;
          this.status = 'Submitting…';
          try {
            const job = await window.fp8.request('POST', '/v1/jobs', {
              body: this.body(), headers: { 'Idempotency-Key': idempotencyKey },
            });
            idempotencyKey = randomKey();
            this.status = 'Job ' + job.id + ' queued; opening it…';
            window.location.assign('/ui/jobs/' + encodeURIComponent(job.id));
          } catch (err) {
            this.showError(err, this.form());
          } finally {
            this.busy = false;
          }
        },
      });
    });
  });
})();
