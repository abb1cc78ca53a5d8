// kvpool's KV dashboard: polls /v1/kv/snapshot and /v1/kv/stats, draws the block map, the
// request table and small time series. Plain JS, no build step. Data from the server is only
// ever put into the page as textContent (request ids are the clients' own strings).
//
// Test hooks: #block-grid carries data-block-count, data-online-blocks, data-state-counts
// (JSON), data-shared-count, data-leased-count, data-highlighted-count, data-cell-size,
// data-columns and data-step; #block-tooltip carries data-block-id; request rows carry
// data-request-id.
"use strict";
(() => {
  // Injected by the server: the block palette (kvpool/inspect/palette.py), the short hash width.
  // A block a live lease holds (a kv_producer's, kept for a decode worker) is drawn in the
  // lease colour whatever its state.
  const CONFIG = JSON.parse(document.getElementById("dashboard-config").textContent);
  const COLOURS = CONFIG.states, STATES = Object.keys(COLOURS);
  const KEY_STORAGE = "kvpool-api-key";
  const POLL_MS = Math.max(200, Number(new URLSearchParams(location.search).get("interval"))
                                || 1500);
  const HISTORY = 120;  // points per time series
  const MAX_ROWS = 500;  // request table rows drawn
  const $ = (id) => document.getElementById(id);

  const CHARTS = [  // [id, title, format, fixed maximum or null (auto)]
    ["usage", "device usage", (v) => pct(v), 1],
    ["hit-rate", "prefix hit rate (tokens)", (v) => pct(v), 1],
    ["alloc-rate", "alloc rate (blocks/s)", (v) => v.toFixed(1), null],
    ["preemptions", "preemptions per poll", (v) => String(v), null],
    ["fragmentation", "internal fragmentation", (v) => pct(v), 1],
  ];
  const series = Object.fromEntries(CHARTS.map(([id]) => [id, []]));
  let latest = null;  // {snapshot, device, host}: the newest poll, indexed
  let previousStats = null;  // the poll before, for deltas
  let selected = null;  // the request id whose blocks are highlighted

  class Unauthorized extends Error {}

  function pct(value) { return (100 * value).toFixed(1) + "%"; }

  // ------------------------------------------------------------------ fetching
  async function getJSON(path) {
    const key = sessionStorage.getItem(KEY_STORAGE);
    const headers = key ? {Authorization: "Bearer " + key} : {};
    const response = await fetch(path, {headers, cache: "no-store"});
    if (response.status === 401) throw new Unauthorized();
    if (!response.ok) throw new Error(path + " answered HTTP " + response.status);
    return response.json();
  }

  async function poll() {
    try {
      const [snapshot, stats] = await Promise.all(
        [getJSON("/v1/kv/snapshot"), getJSON("/v1/kv/stats")]);
      $("key-form").hidden = true;
      update(snapshot, stats);
      $("status").textContent = "step " + snapshot.step + " · updated " +
        new Date(snapshot.time * 1000).toLocaleTimeString();
    } catch (error) {
      if (error instanceof Unauthorized) {
        askForKey();
        return;  // polling resumes once a key is given
      }
      $("status").textContent = "error: " + error.message;
    }
    setTimeout(poll, POLL_MS);
  }

  function askForKey() {
    const hadKey = sessionStorage.getItem(KEY_STORAGE) !== null;
    $("key-error").textContent = hadKey ? "that key was refused" : "";
    $("status").textContent = "waiting for an API key";
    $("key-form").hidden = false;
    $("api-key").focus();
  }

  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY_STORAGE, $("api-key").value.trim());
    $("key-form").hidden = true;
    poll();
  });

  // ------------------------------------------------------------------ the model
  // One pool's runs expanded into per-block arrays (100,000 blocks: a few typed arrays).
  function indexPool(pool) {
    const n = pool.capacity_blocks;
    const state = new Uint8Array(n), run = new Int32Array(n);
    const age = new Float64Array(n).fill(NaN), leases = new Int32Array(n);
    const counts = Object.fromEntries(STATES.map((s) => [s, 0]));
    const other = STATES.indexOf("other");
    pool.runs.forEach(([first, count, name], r) => {
      const code = STATES.indexOf(name);
      state.fill(code < 0 ? other : code, first, first + count);
      run.fill(r, first, first + count);
      counts[name] = (counts[name] || 0) + count;
    });
    for (const [first, count, seconds] of pool.ages) {
      if (seconds !== null) age.fill(seconds, first, first + count);
    }
    let numLeased = 0;
    for (const [first, count, number] of pool.leases || []) {  // older snapshots have none
      leases.fill(number, first, first + count);
      numLeased += count;
    }
    const numShared = pool.runs.reduce((sum, r) => sum + (r[3] > 1 ? r[1] : 0), 0);
    return {pool, n, state, run, age, leases, counts, numShared, numLeased,
            hashes: expandHashes(pool.hashes)};
  }

  // [[first_id, "labels of consecutive ids, concatenated"], ...] -> Map(id -> label)
  function expandHashes(runs) {
    const width = CONFIG.short_hash_chars, hashes = new Map();
    for (const [first, labels] of runs) {
      for (let i = 0; i * width < labels.length; i++) {
        hashes.set(first + i, labels.slice(i * width, (i + 1) * width));
      }
    }
    return hashes;
  }

  function expand(runs) {
    const ids = [];
    for (const [first, count] of runs) for (let i = 0; i < count; i++) ids.push(first + i);
    return ids;
  }

  // `runsOf(seq)`: the id runs a sequence holds in the pool drawn.
  function highlightMask(index, runsOf) {
    if (selected === null) return null;
    const mask = new Uint8Array(index.n);
    for (const seq of latest.snapshot.sequences) {
      if (seq.request_id !== selected) continue;
      for (const id of expand(runsOf(seq))) if (id < index.n) mask[id] = 1;
    }
    return mask;
  }

  // A hybrid model's pools past the first group: "device/g1", "host/g1", ... (name, group,
  // the sequence key listing its blocks per group, the pool indexed).
  function groupPools(snapshot) {
    const found = [];
    for (const [name, pool] of Object.entries(snapshot.pools)) {
      const match = /^(device|host)\/g(\d+)$/.exec(name);
      if (match === null) continue;
      const key = match[1] === "device" ? "group_block_ids" : "group_host_block_ids";
      found.push({name, group: Number(match[2]), key, index: indexPool(pool)});
    }
    return found;
  }

  function update(snapshot, stats) {
    latest = {snapshot, device: indexPool(snapshot.pools.device),
              host: snapshot.pools.host ? indexPool(snapshot.pools.host) : null,
              groups: groupPools(snapshot)};
    if (selected !== null && !snapshot.sequences.some((s) => s.request_id === selected)) {
      selected = null;  // it finished
    }
    record(snapshot, stats);
    previousStats = stats;
    render();
  }

  function record(snapshot, stats) {
    const pool = snapshot.stats;
    const push = (id, value) => {
      series[id].push(value);
      if (series[id].length > HISTORY) series[id].shift();
    };
    push("usage", pool.usage);
    push("alloc-rate", snapshot.derived.alloc_rate);
    push("fragmentation", snapshot.derived.internal_fragmentation);
    if (previousStats === null) return;
    const queries = stats.prefix_cache_queries_tokens - previousStats.prefix_cache_queries_tokens;
    const hits = stats.prefix_cache_hits_tokens - previousStats.prefix_cache_hits_tokens;
    push("hit-rate", queries > 0 ? hits / queries : null);
    push("preemptions", Math.max(0, stats.num_preemptions - previousStats.num_preemptions));
  }

  // ------------------------------------------------------------------ drawing
  function render() {
    const {snapshot, device, host} = latest;
    const view = snapshot.pools.device;
    $("device-summary").textContent = "· " + view.num_blocks + " blocks of " +
      view.block_size + " slots · " + view.kv_cache_dtype + " · " +
      (view.bytes_per_block / 1024).toFixed(1) + " KiB each";
    drawGrid($("block-grid"), device, highlightMask(device, (seq) => seq.block_ids), 420);
    $("block-grid").dataset.step = String(snapshot.step);
    renderLegend(device);
    $("host-section").hidden = host === null;
    if (host !== null) {
      $("host-summary").textContent = "· " + host.pool.num_blocks + " blocks";
      drawGrid($("host-grid"), host, highlightMask(host, (seq) => seq.host_block_ids), 140);
    }
    renderGroups(latest.groups);
    renderCharts();
    renderRequests(snapshot);
  }

  // One titled grid per pool of the other KV cache groups, made on first sight.
  function renderGroups(groups) {
    $("group-section").hidden = groups.length === 0;
    for (const {name, group, key, index} of groups) {
      const id = "grid-" + name.replace("/", "-");
      let canvas = $(id);
      if (canvas === null) {
        const title = document.createElement("h3");
        title.id = id + "-title";
        canvas = document.createElement("canvas");
        canvas.id = id;
        canvas.className = "grid";
        $("group-grids").append(title, canvas);
      }
      $(id + "-title").textContent = name + " · " + index.pool.num_blocks + " blocks online · " +
        (index.pool.bytes_per_block / 1024).toFixed(1) + " KiB each";
      const runsOf = (seq) => (seq[key] || [])[group - 1] || [];
      drawGrid(canvas, index, highlightMask(index, runsOf), 140);
    }
  }

  function layout(canvas, n, maxHeight) {
    const width = Math.max(200, canvas.parentElement.clientWidth);
    const fit = Math.floor(Math.sqrt((width * maxHeight) / Math.max(n, 1)));
    const cell = Math.max(2, Math.min(24, fit));
    const columns = Math.max(1, Math.floor(width / cell));
    return {cell, columns, width: columns * cell, height: Math.ceil(n / columns) * cell};
  }

  // A canvas `width` x `height` CSS pixels drawn at the screen's pixel ratio; its 2D context.
  function sizedContext(canvas, width, height) {
    const ratio = window.devicePixelRatio || 1;
    canvas.width = width * ratio;
    canvas.height = height * ratio;
    canvas.style.width = width + "px";
    canvas.style.height = height + "px";
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    return ctx;
  }

  function drawGrid(canvas, index, mask, maxHeight) {
    const {cell, columns, width, height} = layout(canvas, index.n, maxHeight);
    const ctx = sizedContext(canvas, width, height);
    ctx.fillStyle = CONFIG.background;  // the cells past the last id, and the gaps
    ctx.fillRect(0, 0, width, height);
    const gap = cell >= 6 ? 1 : 0;
    let numHighlighted = 0;
    for (let id = 0; id < index.n; id++) {
      const x = (id % columns) * cell, y = Math.floor(id / columns) * cell;
      const isLit = mask === null || mask[id] === 1;
      numHighlighted += mask !== null && isLit ? 1 : 0;
      ctx.globalAlpha = isLit ? 1 : 0.25;  // a selection fades every other block
      ctx.fillStyle = index.leases[id] > 0 ? CONFIG.leased : COLOURS[STATES[index.state[id]]];
      ctx.fillRect(x, y, cell - gap, cell - gap);
      if (index.pool.runs[index.run[id]][3] > 1) drawSharedMark(ctx, x, y, cell - gap);
    }
    ctx.globalAlpha = 1;
    Object.assign(canvas.dataset, {
      blockCount: String(index.n), onlineBlocks: String(index.pool.num_blocks),
      stateCounts: JSON.stringify(index.counts), sharedCount: String(index.numShared),
      leasedCount: String(index.numLeased), highlightedCount: String(numHighlighted),
      cellSize: String(cell), columns: String(columns),
    });
  }

  function drawSharedMark(ctx, x, y, size) {
    ctx.fillStyle = CONFIG.shared;
    if (size < 6) {
      ctx.fillRect(x, y, 1, 1);
      return;
    }
    ctx.beginPath();
    ctx.arc(x + size / 2, y + size / 2, Math.max(1.5, size * 0.18), 0, 2 * Math.PI);
    ctx.fill();
  }

  function renderLegend(index) {
    const legend = $("legend");
    legend.replaceChildren();
    const entry = (colour, label, isDot) => {
      const item = document.createElement("span");
      const swatch = document.createElement("span");
      swatch.className = isDot ? "swatch dot" : "swatch";
      swatch.style.background = colour;
      item.append(swatch, label);
      legend.append(item);
    };
    for (const state of STATES) entry(COLOURS[state], state + " " + index.counts[state]);
    entry(CONFIG.shared, "shared (ref count > 1) " + index.numShared, true);
    if (index.numLeased > 0) entry(CONFIG.leased, "leased for decode " + index.numLeased);
  }

  function renderCharts() {
    const box = $("charts");
    for (const [id, title, format, fixedMax] of CHARTS) {
      let figure = $("chart-" + id);
      if (figure === null) {
        figure = document.createElement("figure");
        figure.id = "chart-" + id;
        const canvas = document.createElement("canvas");
        canvas.className = "chart";
        figure.append(canvas, document.createElement("figcaption"));
        box.append(figure);
      }
      const points = series[id];
      const last = points.length ? points[points.length - 1] : null;
      figure.dataset.points = String(points.length);
      figure.dataset.last = last === null ? "" : String(last);
      figure.querySelector("figcaption").textContent =
        title + ": " + (last === null ? "–" : format(last));
      drawChart(figure.querySelector("canvas"), points, fixedMax, format);
    }
  }

  function drawChart(canvas, points, fixedMax, format) {
    const width = 220, height = 64;
    const ctx = sizedContext(canvas, width, height);
    const values = points.filter((v) => v !== null);
    const top = fixedMax !== null ? fixedMax : Math.max(1, ...values.map((v) => v * 1.1));
    ctx.fillStyle = "#6b7280";
    ctx.font = "10px system-ui, sans-serif";
    ctx.fillText("max " + (fixedMax !== null ? format(top) : top.toPrecision(3)), 3, 11);
    ctx.strokeStyle = COLOURS.used;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let isDrawing = false;  // a null point (nothing to measure) breaks the line
    points.forEach((value, i) => {
      if (value === null) {
        isDrawing = false;
        return;
      }
      const x = width - 1 - ((points.length - 1 - i) / (HISTORY - 1)) * (width - 2);
      const y = height - 2 - (Math.min(value, top) / top) * (height - 4);
      if (isDrawing) ctx.lineTo(x, y); else ctx.moveTo(x, y);
      isDrawing = true;
    });
    ctx.stroke();
  }

  function renderRequests(snapshot) {
    const body = $("request-table").querySelector("tbody");
    // A sequence keeps its row from poll to poll (a click never lands on a replaced row).
    const existing = new Map([...body.children].map((row) => [row.dataset.key, row]));
    const rows = snapshot.sequences.slice(0, MAX_ROWS).map((seq) => {
      const key = seq.request_id + "\u0000" + seq.index;
      let row = existing.get(key);
      if (row === undefined) {
        row = document.createElement("tr");
        Object.assign(row.dataset, {key, requestId: seq.request_id});
        for (let i = 0; i < 4; i++) row.append(document.createElement("td"));
      }
      row.classList.toggle("selected", seq.request_id === selected);
      const numHost = expand(seq.host_block_ids).length;
      const blocks = expand(seq.block_ids).length + (numHost ? " (+" + numHost + " host)" : "");
      const name = seq.request_id + (seq.index > 0 ? " #" + seq.index : "");
      const texts = [name, seq.status, blocks, seq.num_computed_tokens + " / " + seq.num_tokens];
      texts.forEach((text, i) => { row.children[i].textContent = String(text); });
      return row;
    });
    body.replaceChildren(...rows);
    const hidden = snapshot.sequences.length - rows.length;
    $("request-summary").textContent = "· " + snapshot.sequences.length + " sequences" +
      (hidden > 0 ? " (first " + MAX_ROWS + " shown)" : "");
  }

  $("request-table").addEventListener("click", (event) => {
    const row = event.target.closest("tr[data-request-id]");
    if (row === null || latest === null) return;
    selected = selected === row.dataset.requestId ? null : row.dataset.requestId;
    render();
  });

  // ------------------------------------------------------------------ the tooltip
  function blockAt(canvas, event) {
    const rect = canvas.getBoundingClientRect();
    const cell = Number(canvas.dataset.cellSize), columns = Number(canvas.dataset.columns);
    const column = Math.floor((event.clientX - rect.left) / cell);
    const id = Math.floor((event.clientY - rect.top) / cell) * columns + column;
    return column < columns && id >= 0 && id < Number(canvas.dataset.blockCount) ? id : null;
  }

  function describe(index, id) {
    const [, , state, refCount, filled, holders] = index.pool.runs[index.run[id]];
    const sequences = latest.snapshot.sequences;
    const owners = holders.slice(0, 8).map((h) => {
      const seq = sequences[h];
      return seq.request_id + (seq.index > 0 ? " #" + seq.index : "");
    });
    if (holders.length > 8) owners.push("and " + (holders.length - 8) + " more");
    const lines = ["block " + id + " · " + state, "ref count " + refCount +
                   (refCount > 1 ? " (shared)" : "")];
    if (owners.length) lines.push("owners: " + owners.join(", "));
    if (state === "other") lines.push("owners: another tenant");
    const numLeases = index.leases[id];
    if (numLeases > 0) lines.push(numLeases + " lease(s): kept for a decode worker");
    const hash = index.hashes.get(id);
    if (hash !== undefined) lines.push("hash " + hash);
    lines.push("filled " + filled + " / " + index.pool.block_size + " slots");
    const age = index.age[id];
    if (state === "offline") lines.push("no memory behind this id");
    else lines.push(Number.isNaN(age) ? "not used since start-up" : "age " + age.toFixed(1) + " s");
    return lines.join("\n");
  }

  for (const [canvasId, key] of [["block-grid", "device"], ["host-grid", "host"]]) {
    const canvas = $(canvasId), tooltip = $("block-tooltip");
    canvas.addEventListener("mousemove", (event) => {
      const id = latest && latest[key] ? blockAt(canvas, event) : null;
      if (id === null) {
        tooltip.hidden = true;
        return;
      }
      tooltip.textContent = describe(latest[key], id);
      tooltip.dataset.blockId = String(id);
      tooltip.style.left = event.clientX + 14 + "px";
      tooltip.style.top = event.clientY + 14 + "px";
      tooltip.hidden = false;
    });
    canvas.addEventListener("mouseleave", () => { tooltip.hidden = true; });
  }

  window.addEventListener("resize", () => { if (latest !== null) render(); });
  poll();
})();
