// The one place the pages talk to the server: the public /v1 API, with the tab's API key, and job events
// read as server-sent events over fetch (EventSource cannot send an Authorization header).
(function () {
  'use strict';

  const KEY_NAME = 'fp8forge.apiKey';
  const config = JSON.parse(document.getElementById('fp8-config').textContent);

  function getKey() {
    try { return sessionStorage.getItem(KEY_NAME) || ''; } catch (err) { return ''; }
  }

  function setKey(value) {
    try {
      if (value) sessionStorage.setItem(KEY_NAME, value); else sessionStorage.removeItem(KEY_NAME);
    } catch (err) { /* storage off: the key lives only until the page is left */ }
    window.dispatchEvent(new CustomEvent('fp8:key-changed'));
  }

  function authHeaders(extra) {
    const headers = Object.assign({}, extra || {});
    const key = getKey();
    if (key) headers.Authorization = 'Bearer ' + key;
    return headers;
  }

  // An error response of the API: {"error": {"code", "message", "field"?}}, kept whole for the pages.
  class ApiError extends Error {
    constructor(status, body) {
      const error = (body && body.error) || {};
      super(error.message || (status ? 'The server answered HTTP ' + status : 'The server did not answer.'));
      this.status = status;
      this.code = error.code || (status ? 'http_error' : 'network_error');
      this.field = error.field || null;
    }
  }

  function unauthorized() {
    window.dispatchEvent(new CustomEvent('fp8:unauthorized'));
  }

  async function request(method, path, options) {
    const opts = options || {};
    const init = { method: method, headers: authHeaders(opts.headers), signal: opts.signal, cache: 'no-store' };
    if (opts.body !== undefined) {
      init.body = JSON.stringify(opts.body);
      init.headers['Content-Type'] = 'application/json';
    }
    let response;
    try {
      response = await fetch(path, init);
    } catch (err) {
      if (err.name === 'AbortError') throw err;
      throw new ApiError(0, { error: { message: 'The server did not answer (' + err.message + ').' } });
    }
    if (response.status === 401) unauthorized();
    if (response.status === 204) return null;
    const text = await response.text();
    let data = null;
    try { data = text ? JSON.parse(text) : null; } catch (err) { data = null; }
    if (!response.ok) throw new ApiError(response.status, data);
    return data;
  }

  function sleep(ms, signal) {
    return new Promise(function (resolve) {
      const timer = setTimeout(resolve, ms);
      if (signal) signal.addEventListener('abort', function () { clearTimeout(timer); resolve(); }, { once: true });
    });
  }

  // Reads one text/event-stream body, calling dispatch({event, id, data}) per frame (data parsed as JSON).
  async function readEventStream(body, dispatch) {
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = '';
    let frame = { event: 'message', id: null, data: [] };
    for (;;) {
      const chunk = await reader.read();
      if (chunk.done) return;
      buffer += chunk.value;
      let newline;
      while ((newline = buffer.indexOf('\n')) >= 0) {
        let line = buffer.slice(0, newline);
        buffer = buffer.slice(newline + 1);
        if (line.endsWith('\r')) line = line.slice(0, -1);
        if (line === '') {
          if (frame.data.length) {
            let data = null;
            try { data = JSON.parse(frame.data.join('\n')); } catch (err) { data = { text: frame.data.join('\n') }; }
            dispatch({ event: frame.event, id: frame.id, data: data });
          }
          frame = { event: 'message', id: null, data: [] };
          continue;
        }
        if (line[0] === ':') continue; // keep-alive comment
        const colon = line.indexOf(':');
        const name = colon < 0 ? line : line.slice(0, colon);
        let value = colon < 0 ? '' : line.slice(colon + 1);
        if (value[0] === ' ') value = value.slice(1);
        if (name === 'data') frame.data.push(value);
        else if (name === 'event') frame.event = value;
        else if (name === 'id') frame.id = value;
      }
    }
  }

  // Follows GET /v1/jobs/{id}/events until the job has finished (the server then ends the stream). A broken
  // connection is resumed with Last-Event-ID; isDone() says whether an ended stream is really the end.
  async function followEvents(path, onEvent, options) {
    const opts = options || {};
    const signal = opts.signal;
    const isDone = opts.isDone || function () { return true; };
    let last = opts.lastEventId || 0;
    let failures = 0;
    while (!(signal && signal.aborted)) {
      const headers = authHeaders({ Accept: 'text/event-stream' });
      if (last) headers['Last-Event-ID'] = String(last);
      let response = null;
      try {
        response = await fetch(path, { headers: headers, signal: signal, cache: 'no-store' });
      } catch (err) {
        if (signal && signal.aborted) return last;
      }
      if (response && !response.ok) {
        if (response.status === 401) unauthorized();
        let body = null;
        try { body = await response.json(); } catch (err) { body = null; }
        throw new ApiError(response.status, body);
      }
      if (response) {
        try {
          await readEventStream(response.body, function (frame) {
            if (frame.id) last = Number(frame.id);
            failures = 0;
            onEvent(frame.event, frame.data);
          });
          if (isDone()) return last;
        } catch (err) {
          if (signal && signal.aborted) return last;
        }
      }
      failures += 1;
      await sleep(Math.min(500 * 2 ** failures, 10000), signal);
    }
    return last;
  }

  // --- jobs as the pages show them -----------------------------------------------------------------

  const STAGES = config.stages;
  const FINISHED = config.finished;

  // The server's Job.progress: finished stages plus the fraction of the current one, over all stages.
  // The fraction done, of the stages the job runs (as the API's Job.progress counts them: job_stages in
  // converters/pipeline/state.py): a requantize job runs analyze, convert and export; plan only when asked.
  function progressFraction(status, stage, done, total, request) {
    if (status === 'succeeded') return 1;
    const stages = request && request.requantize ? ['analyze', 'convert', 'export']
      : STAGES.filter(function (name) { return name !== 'plan' || (request && request.plan); });
    const index = stages.indexOf(stage);
    if (index < 0) return 0;
    const within = total > 0 ? Math.min(done / total, 1) : 0;
    return (index + within) / stages.length;
  }

  function isFinished(status) { return FINISHED.indexOf(status) >= 0; }

  function formatSeconds(seconds) {
    if (seconds === null || seconds === undefined || !isFinite(seconds)) return '';
    if (seconds < 1) return '<1 s';
    if (seconds < 90) return Math.round(seconds) + ' s';
    if (seconds < 5400) return Math.round(seconds / 60) + ' min';
    return (seconds / 3600).toFixed(1) + ' h';
  }

  function formatBytes(bytes) {
    if (bytes === null || bytes === undefined) return '';
    const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    let value = bytes;
    let unit = 0;
    while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
    return (unit === 0 ? String(value) : value.toFixed(value < 10 ? 2 : 1)) + ' ' + units[unit];
  }

  function formatTime(iso) {
    if (!iso) return '';
    const date = new Date(iso);
    return isNaN(date) ? iso : date.toLocaleString();
  }

  function formatPercent(share) {
    if (share === null || share === undefined) return '';
    return (100 * share).toFixed(share < 0.1 && share > 0 ? 1 : 0) + '%';
  }

  //: How the pages name each job kind (JobPublic.kind).
  const KINDS = { calibrated: 'calibrated', plan: 'calibrated + plan', requantize: 'requantize' };
  const FAILURE_CHARS = 160;

  // An error's first line, cut to FAILURE_CHARS: a list row shows this much, the page and the tooltip the rest.
  function firstLine(text) {
    const line = text.split('\n')[0];
    const cut = line.length > FAILURE_CHARS ? line.slice(0, FAILURE_CHARS - 1) : line;
    return cut + (cut !== text ? '…' : '');
  }

  // A path in pieces that each end at a "/": a row breaks a long path between them, never inside a name.
  function pathParts(path) {
    return path.split(/(?<=\/)/);
  }

  // A recipe as a short name: "te delayed E4M3", "ao rowwise", "te mxfp8_block" (the API's default: "te").
  function recipeText(recipe) {
    if (!recipe) return '';
    const kind = recipe.scaling || recipe.recipe_name || (recipe.backend === 'te' ? 'delayed' : '');
    return [recipe.backend, kind, recipe.fp8_format].filter(Boolean).join(' ');
  }

  // Adds what a row shows (percent, ETA, duration, recipe, exports, failure, which buttons apply) to a job as the
  // API returns it.
  function decorateJob(job, now) {
    const fraction = job.status === 'succeeded' ? 1 : (job.progress ? job.progress.fraction : 0);
    job.fraction = fraction;
    job.percent = Math.round(100 * fraction) + '%';
    job.short = job.id.slice(0, 8);
    job.href = '/ui/jobs/' + encodeURIComponent(job.id);
    job.model = (job.request && job.request.model) || '(request hidden)';
    job.modelParts = pathParts(job.model);
    job.kind = job.kind || 'calibrated';
    job.kindText = KINDS[job.kind] || job.kind;
    job.cancellable = job.status === 'queued' || job.status === 'running';
    job.deletable = isFinished(job.status);
    job.finished = isFinished(job.status);
    job.created = formatTime(job.created_at);
    job.stageText = job.stage && !job.finished ? job.stage + (job.progress && job.progress.stage_total
      ? ' ' + job.progress.stage_done + '/' + job.progress.stage_total : '') : '';
    job.progressLabel = 'Progress of job ' + job.short + ': ' + job.percent;
    const requantize = job.request && job.request.requantize;
    // a requantize job has no recipe (nothing is calibrated): its one export is its target format
    job.recipeText = !job.request ? '' : requantize ? 'no recipe' : recipeText(job.request.recipe || { backend: 'te' });
    job.exportsText = !job.request ? '' : requantize ? requantize.to : (job.request.serving_formats || []).join(', ') || '—';
    job.duration = '';
    if (job.started_at) {
      const end = job.finished_at ? new Date(job.finished_at).getTime() : (job.finished ? null : (now || Date.now()));
      if (end !== null) job.duration = formatSeconds((end - new Date(job.started_at).getTime()) / 1000);
    }
    job.failure = job.error ? job.error.code + ': ' + job.error.message : '';
    job.failureLine = job.failure ? firstLine(job.failure) : '';
    job.eta = '';
    if (job.status === 'running' && job.started_at && fraction > 0.02 && fraction < 1) {
      const elapsed = ((now || Date.now()) - new Date(job.started_at).getTime()) / 1000;
      job.eta = 'about ' + formatSeconds(elapsed * (1 - fraction) / fraction);
    }
    return job;
  }

  // Applies one event of the job's stream to the job object the page shows.
  function applyEvent(job, kind, data) {
    if (kind === 'status') {
      job.status = data.status;
      if (data.status === 'running') { job.started_at = data.at; job.attempt = data.attempt || job.attempt; }
      if (data.status === 'queued') { job.stage = null; job.progress = { fraction: 0, stage_done: 0, stage_total: 0 }; }
    } else if (kind === 'stage') {
      job.stage = data.stage;
      job.progress = { fraction: progressFraction(job.status, data.stage, 0, 0, job.request), stage_done: 0, stage_total: 0 };
    } else if (kind === 'progress') {
      job.stage = data.stage || job.stage;
      job.progress = {
        fraction: progressFraction(job.status, job.stage, data.done, data.total, job.request),
        stage_done: data.done, stage_total: data.total,
      };
    }
    return decorateJob(job);
  }

  // Saves an artifact. Without a key a plain link does it; with one the file is fetched with the header.
  async function download(url, name) {
    const response = await fetch(url, { headers: authHeaders(), cache: 'no-store' });
    if (!response.ok) {
      if (response.status === 401) unauthorized();
      let body = null;
      try { body = await response.json(); } catch (err) { body = null; }
      throw new ApiError(response.status, body);
    }
    const blob = await response.blob();
    const link = document.createElement('a');
    link.href = URL.createObjectURL(blob);
    link.download = name.split('/').pop();
    document.body.appendChild(link);
    link.click();
    link.remove();
    setTimeout(function () { URL.revokeObjectURL(link.href); }, 10000);
  }

  window.fp8 = {
    config: config, ApiError: ApiError, getKey: getKey, setKey: setKey, request: request,
    followEvents: followEvents, progressFraction: progressFraction, isFinished: isFinished,
    decorateJob: decorateJob, applyEvent: applyEvent, download: download, pathParts: pathParts,
    formatBytes: formatBytes, formatSeconds: formatSeconds, formatTime: formatTime, formatPercent: formatPercent,
    recipeText: recipeText,
  };

  document.addEventListener('alpine:init', function () {
    // The API key form in the header: kept in this tab's sessionStorage, sent as a bearer token.
    window.Alpine.data('apiKey', function () {
      return {
        draft: '',
        hasKey: false,
        needed: false,
        init() {
          this.hasKey = Boolean(getKey());
          const self = this;
          window.addEventListener('fp8:unauthorized', function () {
            self.needed = true;
            self.hasKey = Boolean(getKey());
            self.$nextTick(function () { document.getElementById('api-key').focus(); });
          });
        },
        get keyStatus() {
          if (this.needed) return this.hasKey ? 'The server refused this key: enter another.' : 'This server needs an API key.';
          return this.hasKey ? 'Key set for this tab.' : 'No key set.';
        },
        save() {
          const value = this.draft.trim();
          if (!value) return;
          this.draft = '';
          this.needed = false;
          this.hasKey = true;
          setKey(value);
        },
        forget() {
          this.draft = '';
          this.hasKey = false;
          setKey('');
        },
      };
    });
  });
})();
