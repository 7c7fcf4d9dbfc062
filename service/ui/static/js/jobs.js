// Jobs page: GET /v1/jobs (filter by status, pages), live rows from each active job's event stream,
// cancel / delete, and the artifacts (size, sha256) of succeeded jobs.
(function () {
  'use strict';

  // A browser holds about six connections per server; streams beyond this many would starve the page's
  // other requests, so further active jobs are refreshed by the periodic reload instead.
  const MAX_STREAMS = 4;
  const RELOAD_MS = 10000;

  document.addEventListener('alpine:init', function () {
    window.Alpine.data('jobsPage', function () {
      const streams = new Map(); // job id -> AbortController
      let timer = null;
      return {
        jobs: [],
        status: new URLSearchParams(window.location.search).get('status') || '',
        nextCursor: null,
        error: '',
        summary: '',

        init() {
          const self = this;
          this.reload();
          timer = setInterval(function () { self.reload(); }, RELOAD_MS);
          window.addEventListener('fp8:key-changed', function () { self.reload(); });
        },

        destroy() {
          clearInterval(timer);
          streams.forEach(function (controller) { controller.abort(); });
        },

        // The status filter changed: reload, and keep the filter in the address (a link or reload keeps it).
        filter() {
          const url = new URL(window.location.href);
          if (this.status) url.searchParams.set('status', this.status); else url.searchParams.delete('status');
          window.history.replaceState(null, '', url);
          this.reload();
        },

        async reload() {
          const query = new URLSearchParams({ limit: '50' });
          if (this.status) query.set('status', this.status);
          try {
            const page = await window.fp8.request('GET', '/v1/jobs?' + query);
            this.error = '';
            const known = new Map(this.jobs.map(function (job) { return [job.id, job]; }));
            this.jobs = page.data.map(function (job) {
              const old = known.get(job.id);
              if (old && old.artifacts) job.artifacts = old.artifacts;
              return window.fp8.decorateJob(job);
            });
            this.nextCursor = page.next_cursor;
            this.summarize();
            this.follow();
          } catch (err) {
            this.error = err.message;
          }
        },

        async more() {
          const query = new URLSearchParams({ limit: '50', cursor: this.nextCursor });
          if (this.status) query.set('status', this.status);
          try {
            const page = await window.fp8.request('GET', '/v1/jobs?' + query);
            this.jobs = this.jobs.concat(page.data.map(function (job) { return window.fp8.decorateJob(job); }));
            this.nextCursor = page.next_cursor;
            this.summarize();
            this.follow();
          } catch (err) {
            this.error = err.message;
          }
        },

        summarize() {
          const active = this.jobs.filter(function (job) { return !job.finished; }).length;
          this.summary = this.jobs.length
            ? this.jobs.length + ' job(s) shown, ' + active + ' active.'
            : 'No jobs' + (this.status ? ' with status ' + this.status : '') + ' yet.';
        },

        // Opens an event stream for active jobs (up to MAX_STREAMS) and closes those of jobs no longer shown.
        follow() {
          const self = this;
          const shown = new Set(this.jobs.map(function (job) { return job.id; }));
          streams.forEach(function (controller, id) {
            if (!shown.has(id)) { controller.abort(); streams.delete(id); }
          });
          this.jobs.forEach(function (job) {
            if (job.finished || streams.has(job.id) || streams.size >= MAX_STREAMS) return;
            const controller = new AbortController();
            streams.set(job.id, controller);
            const id = job.id;
            window.fp8.followEvents(job.links.events, function (kind, data) {
              self.onEvent(id, kind, data);
            }, {
              signal: controller.signal,
              isDone: function () { const row = self.find(id); return !row || row.finished; },
            }).catch(function () { /* deleted or not ours any more: the next reload shows it */ })
              .finally(function () { streams.delete(id); });
          });
        },

        find(id) {
          return this.jobs.find(function (job) { return job.id === id; });
        },

        onEvent(id, kind, data) {
          const job = this.find(id);
          if (!job) return;
          window.fp8.applyEvent(job, kind, data);
          if (kind === 'status' && window.fp8.isFinished(data.status)) this.refresh(id);
        },

        // A finished job's row is re-read: error, artifacts and links arrive with the final state.
        async refresh(id) {
          try {
            const fresh = window.fp8.decorateJob(await window.fp8.request('GET', '/v1/jobs/' + encodeURIComponent(id)));
            const index = this.jobs.findIndex(function (job) { return job.id === id; });
            if (index >= 0) this.jobs.splice(index, 1, fresh);
            this.summarize();
          } catch (err) {
            this.error = err.message;
          }
        },

        async cancel(job) {
          try {
            const fresh = await window.fp8.request('POST', '/v1/jobs/' + encodeURIComponent(job.id) + '/cancel');
            Object.assign(job, window.fp8.decorateJob(fresh));
            this.summary = 'Job ' + job.short + ' is ' + job.status + '.';
            this.follow();
          } catch (err) {
            this.error = 'Cancel ' + job.short + ': ' + err.message;
          }
        },

        async remove(job) {
          if (!window.confirm('Delete job ' + job.short + ' and its artifacts?')) return;
          try {
            await window.fp8.request('DELETE', '/v1/jobs/' + encodeURIComponent(job.id));
            this.jobs = this.jobs.filter(function (other) { return other.id !== job.id; });
            this.summary = 'Job ' + job.short + ' deleted.';
          } catch (err) {
            this.error = 'Delete ' + job.short + ': ' + err.message;
          }
        },

        async loadArtifacts(job) {
          if (job.artifacts) return;
          try {
            const list = await window.fp8.request('GET', job.links.artifacts);
            job.artifacts = list.data.map(function (artifact) {
              artifact.size = window.fp8.formatBytes(artifact.bytes);
              return artifact;
            });
          } catch (err) {
            this.error = err.message;
          }
        },

        download(event, artifact) {
          if (!window.fp8.getKey()) return; // a plain link works on a server without keys
          event.preventDefault();
          const self = this;
          window.fp8.download(artifact.url, artifact.name).catch(function (err) { self.error = err.message; });
        },
      };
    });
  });
})();
