// New job form: builds the POST /v1/jobs body from the fields (or from an Accelerate config.yaml, which the
// server reads into a recipe) and shows each API error next to the field its `field` path names.
(function () {
  'use strict';

  function randomKey() {
    const bytes = new Uint8Array(16);
    window.crypto.getRandomValues(bytes); // randomUUID needs a secure context; this works on plain http too
    return Array.from(bytes, function (b) { return b.toString(16).padStart(2, '0'); }).join('');
  }

  function paragraphs(text) {
    return text.split(/\n[ \t]*\n/).map(function (part) { return part.trim(); }).filter(Boolean);
  }

  // With the recipe taken from YAML, the API's recipe.* errors belong to the YAML box, but for the options every
  // recipe takes: the YAML holds none of them, their own control sent them.
  function redirect(key) {
    if (this.source !== 'yaml' || !(key === 'recipe' || key.startsWith('recipe.'))) return key;
    return document.querySelector('[data-recipe-shared] [data-field="' + key + '"]') ? key : 'recipe_yaml';
  }

  document.addEventListener('alpine:init', function () {
    window.Alpine.data('newJobForm', function () {
      const LocalError = window.fp8forms.LocalError;
      let idempotencyKey = randomKey(); // a resubmission after a lost answer gives the same job
      return Object.assign(window.fp8forms.mixin(redirect), {
        source: 'fields',
        backend: 'te',
        scaling: 'delayed',
        aoScaling: 'float8_linear',
        planTarget: 'none',
        yaml: '',

        form() { return document.getElementById('job-form'); },
        init() { this.collectFields(this.form()); },

        value(name) { return this.form().elements.namedItem(name).value; },
        checked(name) { return this.form().elements.namedItem(name).checked; },
        number(name) { return this.numberField(this.form(), name); },

        // A recipe of service/ui/recipe_variants.py: its options are the inputs of its own box.
        variantRecipe(backend, scaling) {
          const box = this.form().querySelector('[data-recipe-variant="' + backend + '/' + scaling + '"]');
          return this.readOptions(box, { backend: backend, scaling: scaling });
        },

        // The options (inputs with data-option) of a box of the form, each as the recipe field it names.
        readOptions(box, recipe) {
          box.querySelectorAll('[data-option]').forEach(function (input) {
            const option = input.dataset.option;
            if (input.type === 'checkbox') {
              recipe[option] = input.checked;
            } else if (input.type === 'number') {
              if (input.validity.badInput) throw new LocalError('recipe.' + option, 'Enter a whole number.');
              recipe[option] = input.value.trim() === '' ? undefined : Number(input.value);
            } else {
              recipe[option] = input.value;
            }
          });
          return recipe;
        },

        recipeFromFields() {
          if (this.backend === 'ao' && this.aoScaling !== 'float8_linear') return this.variantRecipe('ao', this.aoScaling);
          if (this.backend === 'te' && this.scaling !== 'delayed' && this.scaling !== 'current') {
            return this.variantRecipe('te', this.scaling);
          }
          if (this.backend === 'ao') {
            return {
              backend: 'ao', recipe_name: this.value('recipe.recipe_name'),
              pad_inner_dim: this.checked('recipe.pad_inner_dim'),
              enable_fsdp_float8_all_gather: this.checked('recipe.enable_fsdp_float8_all_gather'),
              emulate: this.checked('recipe.emulate'),
            };
          }
          if (this.scaling === 'current') {
            return { backend: 'te', scaling: 'current', fp8_format: this.value('recipe.fp8_format') };
          }
          const recipe = {
            backend: 'te', scaling: 'delayed', fp8_format: this.value('recipe.fp8_format'),
            amax_history_len: this.number('recipe.amax_history_len'),
            amax_compute_algo: this.value('recipe.amax_compute_algo'),
            margin: this.number('recipe.margin'),
            use_autocast_during_eval: this.checked('recipe.use_autocast_during_eval'),
            interval: this.number('recipe.interval'),
          };
          // the keys TE removed: sent only when set, as an Accelerate config that carries them does
          const precision = Array.from(this.form().querySelectorAll('input[name="recipe.override_linear_precision"]'),
            function (box) { return box.checked; });
          if (precision.some(Boolean)) recipe.override_linear_precision = precision;
          return recipe;
        },

        async recipeFromYaml() {
          if (!this.yaml.trim()) throw new LocalError('recipe_yaml', 'Paste or load an Accelerate config.yaml.');
          try {
            const answer = await window.fp8.request('POST', '/ui/api/recipe-from-yaml', { body: { yaml: this.yaml } });
            return answer.recipe;
          } catch (err) {
            if (err.status === 422) throw new LocalError('recipe_yaml', err.message);
            throw err;
          }
        },

        async body() {
          const body = { model: this.value('model').trim() };
          body.recipe = this.source === 'yaml' ? await this.recipeFromYaml() : this.recipeFromFields();
          this.readOptions(this.form().querySelector('[data-recipe-shared]'), body.recipe);
          const calibration = {
            steps: this.number('calibration.steps'),
            batch_size: this.number('calibration.batch_size'),
            seq_len: this.number('calibration.seq_len'),
          };
          if (this.checked('calibration.backward')) calibration.backward = true;
          const texts = paragraphs(this.value('calibration.texts'));
          if (texts.length) calibration.texts = texts;
          body.calibration = calibration;
          const include = window.fp8forms.lines(this.value('include'));
          const exclude = window.fp8forms.lines(this.value('exclude'));
          if (include.length) body.include = include;
          if (exclude.length) body.exclude = exclude;
          body.skip_first_last = this.checked('skip_first_last');
          if (this.checked('convert_router_gates')) body.convert_router_gates = true;
          const serving = Array.from(this.form().querySelectorAll('input[name="serving_formats"]:checked'),
            function (box) { return box.value; });
          if (serving.length) body.serving_formats = serving;
          const kvCache = this.value('kv_cache');
          if (kvCache && kvCache !== 'none') body.kv_cache = kvCache;
          if (!this.checked('measure')) body.measure = false;
          const minimum = this.form().elements.namedItem('min_sqnr_db');
          if (minimum.validity.badInput) throw new LocalError('min_sqnr_db', 'Enter a number of dB.');
          if (minimum.value.trim() !== '') body.min_sqnr_db = Number(minimum.value);
          if (this.planTarget !== 'none') body.plan = this.plan();
          if (body.recipe.backend === 'te' && this.checked('te_extra_state')) body.te_extra_state = true;
          return JSON.parse(JSON.stringify(body)); // drops the numbers left empty (undefined)
        },

        // plan: the chosen target and its value (empty: the API says what is missing), objective, GPU.
        plan() {
          const field = 'plan.' + this.planTarget;
          const input = this.form().elements.namedItem(field);
          if (input.validity.badInput) throw new LocalError(field, 'Enter a number.');
          const plan = { objective: this.value('plan.objective'), gpu: this.value('plan.gpu') };
          plan[this.planTarget] = input.value.trim() === '' ? null : Number(input.value);
          return plan;
        },

        async submit() {
          if (this.busy) return;
          this.clearErrors();
          this.busy = true;
          this.status = 'Submitting…';
          try {
            const body = await this.body();
            const job = await window.fp8.request('POST', '/v1/jobs', {
              body: body, headers: { 'Idempotency-Key': idempotencyKey },
            });
            idempotencyKey = randomKey(); // the next submission is another job
            this.status = 'Job ' + job.id + ' queued; opening it…';
            window.location.assign('/ui/jobs/' + encodeURIComponent(job.id));
          } catch (err) {
            this.showError(err, this.form());
          } finally {
            this.busy = false;
          }
        },

        loadYaml(event) {
          const file = event.target.files[0];
          if (!file) return;
          const self = this;
          file.text().then(function (text) { self.yaml = text; });
        },
      });
    });
  });
})();
