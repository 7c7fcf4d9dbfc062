// One job: its state from GET /v1/jobs/{id}, kept live by its event stream, cancel / delete, its artifacts,
// and once it has succeeded the report (fp8_report.json, downloaded through the artifacts API).
(function () {
  'use strict';

  const MAX_EVENTS = 200;

  function describe(kind, data) {
    if (kind === 'status') return data.status + (data.reason ? ' (' + data.reason + ')' : '') + (data.message ? ': ' + data.message : '');
    if (kind === 'stage') return data.stage;
    if (kind === 'progress') return data.stage + ' ' + data.done + '/' + data.total;
    if (kind === 'warning') return data.message;
    return JSON.stringify(data);
  }

  document.addEventListener('alpine:init', function () {
    window.Alpine.data('jobPage', function () {
      const jobId = document.getElementById('job-page').dataset.jobId;
      const base = '/v1/jobs/' + encodeURIComponent(jobId);
      let stream = null;
      let eventCount = 0;
      return Object.assign(window.fp8analysis.mixin(), window.fp8report.mixin(), window.fp8quality.mixin(), {
        job: null,
        loadError: '',
        announcement: '',
        times: {},
        requestJson: '',
        events: [],
        artifacts: [],
        reportReady: false,
        reportStatus: '',

        init() {
          const self = this;
          this.load();
          window.addEventListener('fp8:key-changed', function () { self.load(); });
        },

        destroy() { if (stream) stream.abort(); },

        setJob(job) {
          this.job = window.fp8.decorateJob(job);
          this.times = {
            created: window.fp8.formatTime(job.created_at), started: window.fp8.formatTime(job.started_at),
            finished: window.fp8.formatTime(job.finished_at),
          };
          this.requestJson = job.request ? JSON.stringify(job.request, null, 2) : '';
        },

        async load() {
          try {
            this.setJob(await window.fp8.request('GET', base));
            this.loadError = '';
          } catch (err) {
            this.loadError = err.status === 404 ? 'No job ' + jobId + ' (or not yours).' : err.message;
            return;
          }
          if (this.job.finished) this.finished();
          else this.follow();
        },

        follow() {
          if (stream) stream.abort();
          stream = new AbortController();
          const self = this;
          window.fp8.followEvents(this.job.links.events, function (kind, data) { self.onEvent(kind, data); }, {
            signal: stream.signal, isDone: function () { return self.job && self.job.finished; },
          }).catch(function (err) { self.loadError = err.message; });
        },

        onEvent(kind, data) {
          eventCount += 1;
          const time = data.at ? new Date(data.at).toLocaleTimeString() : '';
          this.events.push({ key: eventCount, kind: kind, time: time, text: describe(kind, data) });
          if (this.events.length > MAX_EVENTS) this.events.splice(0, this.events.length - MAX_EVENTS);
          const before = this.job.status + ' ' + this.job.stage;
          window.fp8.applyEvent(this.job, kind, data);
          if (kind === 'status') this.times.started = window.fp8.formatTime(this.job.started_at);
          if (before !== this.job.status + ' ' + this.job.stage) {
            this.announcement = 'Job ' + this.job.status + (this.job.stage && !this.job.finished ? ', stage ' + this.job.stage : '') + '.';
          }
          if (kind === 'status' && window.fp8.isFinished(data.status)) this.reloadFinished();
        },

        async reloadFinished() {
          try {
            this.setJob(await window.fp8.request('GET', base));
          } catch (err) {
            this.loadError = err.message;
            return;
          }
          this.finished();
        },

        finished() {
          if (this.job.status === 'succeeded') {
            this.loadArtifacts();
            this.loadReport();
          }
        },

        async loadArtifacts() {
          try {
            const list = await window.fp8.request('GET', this.job.links.artifacts);
            this.artifacts = list.data.map(function (artifact) {
              artifact.size = window.fp8.formatBytes(artifact.bytes);
              return artifact;
            });
          } catch (err) {
            this.loadError = err.message;
          }
        },

        async loadReport() {
          if (!this.job.links.report) { this.reportStatus = 'This job has no report file.'; return; }
          this.reportStatus = 'Loading the report…';
          try {
            const report = await window.fp8.request('GET', this.job.links.report);
            this.reportReady = true;
            this.reportStatus = '';
            const self = this;
            this.$nextTick(function () { self.showReport(report); });
          } catch (err) {
            this.reportStatus = 'The report could not be loaded: ' + err.message;
          }
        },

        async cancel() {
          try {
            this.setJob(await window.fp8.request('POST', base + '/cancel'));
            this.announcement = 'Job ' + this.job.status + '.';
          } catch (err) {
            this.loadError = err.message;
          }
        },

        async remove() {
          if (!window.confirm('Delete this job and its artifacts?')) return;
          try {
            await window.fp8.request('DELETE', base);
            window.location.assign('/ui/jobs');
          } catch (err) {
            this.loadError = err.message;
          }
        },

        download(event, artifact) {
          if (!window.fp8.getKey()) return; // a plain link works on a server without keys
          event.preventDefault();
          const self = this;
          window.fp8.download(artifact.url, artifact.name).catch(function (err) { self.loadError = err.message; });
        },
      });
    });
  });
})();
