// One job: its state from GET /v1/jobs/{id}, kept live by its event stream, cancel / delete, its tasks (which worker
// ran which shard), its artifacts (one by one or all in a tar), and once it has succeeded the report of its kind
// (fp8_report.json, or a requantize job's requantize_report.json, downloaded through the artifacts API).
(function () {
  'use strict';

  const MAX_EVENTS = 200;
  //: while a job runs, its task list is re-read at most this often (progress events say when a task finished)
  const TASKS_EVERY_MS = 2000;

  function taskRow(task) {
    return {
      name: task.name, parts: window.fp8.pathParts(task.name), kind: task.kind, status: task.status,
      worker: task.worker || '—', host: task.host || '—', attempt: task.attempt + ' of ' + task.max_attempts,
      started: task.started_at ? new Date(task.started_at).toLocaleTimeString() : '—',
      finished: task.finished_at ? new Date(task.finished_at).toLocaleTimeString() : '—',
      seconds: typeof task.seconds === 'number' ? task.seconds.toFixed(2) : '—',
      error: task.error ? task.error.code + ': ' + task.error.message : '',
      errorLine: task.error ? task.error.code + ': ' + task.error.message.split('\n')[0] : '',
    };
  }

  function describe(kind, data) {
    if (kind === 'status') return data.status + (data.reason ? ' (' + data.reason + ')' : '') + (data.message ? ': ' + data.message : '');
    if (kind === 'stage') return data.stage;
    if (kind === 'progress') return data.text || data.stage + ' ' + data.done + '/' + data.total;  // the CLI's words
    if (kind === 'warning') return data.message;
    return JSON.stringify(data);
  }

  document.addEventListener('alpine:init', function () {
    window.Alpine.data('jobPage', function () {
      const jobId = document.getElementById('job-page').dataset.jobId;
      const base = '/v1/jobs/' + encodeURIComponent(jobId);
      let stream = null;
      let eventCount = 0;
      let tasksRead = 0;
      return Object.assign(window.fp8analysis.mixin(), window.fp8report.mixin(), window.fp8quality.mixin(),
        window.fp8requantize.mixin(), {
        job: null,
        loadError: '',
        announcement: '',
        times: {},
        requestJson: '',
        events: [],
        artifacts: [],
        reportReady: false,
        reportStatus: '',
        tasks: [],
        tasksText: '',
        artifactsText: '',

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
          this.loadTasks();
          if (this.job.finished) this.finished();
          else this.follow();
        },

        // GET /v1/jobs/{id}/tasks: none for a job that is not split into tasks (the section stays hidden).
        async loadTasks() {
          tasksRead = Date.now();
          try {
            const list = await window.fp8.request('GET', this.job.links.tasks || base + '/tasks');
            this.tasks = list.data.map(taskRow);
            const done = list.data.filter(function (task) { return task.status === 'succeeded'; }).length;
            const workers = new Set(list.data.map(function (task) { return task.worker; }).filter(Boolean));
            this.tasksText = done + ' of ' + list.count + ' tasks succeeded, run by ' + workers.size + ' worker(s).';
          } catch (err) {
            this.tasksText = 'The tasks could not be loaded: ' + err.message;
          }
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
          else if (kind === 'progress' && Date.now() - tasksRead > TASKS_EVERY_MS) this.loadTasks();
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
          this.loadTasks();
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
            const total = list.data.reduce(function (sum, artifact) { return sum + artifact.bytes; }, 0);
            this.artifactsText = list.count + ' files, ' + window.fp8.formatBytes(total);
          } catch (err) {
            this.loadError = err.message;
          }
        },

        async loadReport() {
          if (!this.job.links.report) { this.reportStatus = 'This job has no report file.'; return; }
          this.reportStatus = 'Loading the report…';
          try {
            const report = await window.fp8.request('GET', this.job.links.report);
            this.reportReady = this.job.kind !== 'requantize';
            this.reportStatus = '';
            const self = this;
            if (this.job.kind === 'requantize') this.showRequantize(report);
            else this.$nextTick(function () { self.showReport(report); });
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

        downloadAll(event) {
          this.download(event, { url: this.job.links.archive, name: 'fp8forge-job-' + this.job.id + '.tar' });
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
