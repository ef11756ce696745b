// tensor-broker cluster dashboard: polls the broker's `api/v1/cluster` every second and
// renders the summary, the nodes table, a throughput chart (uPlot), transfer latency and the
// registry. Plain JS, no build step, nothing fetched from outside the broker.
//
// The API may require a bearer token (the broker's --http-token-file). The page takes it from
// its address (`#token=TOKEN`, removed from the address bar at once and kept in this tab's
// sessionStorage), or from a form it shows in the banner when the API answers 401, and sends
// it as `Authorization: Bearer TOKEN`. Only the first page of registry entries is fetched; the
// summary counts come from the API's totals for the whole registry.
//
// Everything that comes from the API is untrusted (tensor names, addresses, URLs): the DOM is
// built with createElement/textContent only, never innerHTML, and links are checked to be
// http(s) before they are used.
"use strict";

(function () {
  const API = "api/v1/cluster";
  const PAGE_LIMIT = 1000; // registry entries fetched per poll (the first page)
  const TOKEN_KEY = "tb-http-token";
  const POLL_MS = 1000;
  const RETRY_MAX_MS = 5000;
  const FETCH_TIMEOUT_MS = 4000;
  const HISTORY_S = 120;
  const MAX_NODES = 512; // rows and chart series are bounded whatever the API sends
  const MAX_ROWS = 500; // registry rows rendered after filtering
  const CHART_HEIGHT = 260;
  const PALETTE = ["#38bdf8", "#a78bfa", "#34d399", "#fbbf24", "#f472b6", "#fb7185",
    "#2dd4bf", "#c084fc", "#facc15", "#60a5fa", "#4ade80", "#f97316"];
  const IN_COLOR = "#34d399";
  const OUT_COLOR = "#818cf8";

  const $ = (id) => document.getElementById(id);

  // ---- untrusted input -------------------------------------------------------------------
  const num = (v) => (typeof v === "number" && Number.isFinite(v) ? v : null);
  const str = (v) => (typeof v === "string" ? v : "");
  const arr = (v, max) => (Array.isArray(v) ? v.slice(0, max) : []);
  const obj = (v) => (v !== null && typeof v === "object" && !Array.isArray(v) ? v : null);

  function safeUrl(raw) {
    try {
      const u = new URL(str(raw), window.location.href);
      return u.protocol === "http:" || u.protocol === "https:" ? u : null;
    } catch (_) {
      return null;
    }
  }

  // ---- formatting ------------------------------------------------------------------------
  const UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];

  function bytes(n) {
    if (n === null) return "—";
    let v = Math.max(0, n);
    let i = 0;
    while (v >= 1024 && i < UNITS.length - 1) {
      v /= 1024;
      i += 1;
    }
    const digits = i === 0 || v >= 100 ? 0 : v >= 10 ? 1 : 2;
    return v.toFixed(digits) + " " + UNITS[i];
  }

  const rate = (n) => (n === null ? "—" : bytes(n) + "/s");
  const tally = (n) => (n === null ? "—" : String(Math.round(n)));
  const callRate = (n) => (n === null ? "—" : (n >= 100 ? n.toFixed(0) : n.toFixed(1)) + "/s");

  function seconds(s) {
    if (s === null) return "—";
    if (s < 1e-3) return (s * 1e6).toFixed(0) + " µs";
    if (s < 1) return (s * 1e3).toFixed(s < 0.01 ? 2 : 1) + " ms";
    return s.toFixed(2) + " s";
  }

  function uptime(s) {
    if (s === null) return "—";
    const t = Math.floor(s);
    const d = Math.floor(t / 86400);
    const h = Math.floor((t % 86400) / 3600);
    const m = Math.floor((t % 3600) / 60);
    if (d > 0) return d + "d " + h + "h";
    if (h > 0) return h + "h " + m + "m";
    if (m > 0) return m + "m " + (t % 60) + "s";
    return t + "s";
  }

  const shortId = (id) => (id.length > 10 ? id.slice(0, 8) + "…" : id || "?");

  // ---- DOM helpers -----------------------------------------------------------------------
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") e.className = v;
      else if (k.startsWith("data-") || k === "title" || k === "href" || k === "target" ||
               k === "rel" || k === "style") e.setAttribute(k, String(v));
      else e[k] = v;
    }
    for (const c of children) {
      if (c === null || c === undefined) continue;
      e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return e;
  }

  function setText(sel, text) {
    for (const e of document.querySelectorAll(sel)) e.textContent = text;
  }

  // ---- the model: one row per node, whatever the API's shape ----------------------------
  /** Normalises the broker's own status object into the member-stats shape. */
  function brokerStats(b) {
    const pool = obj(b.pool) || {};
    const store = obj(b.store) || {};
    const tp = obj(b.throughput) || {};
    const tr = obj(b.transfers) || {};
    const lat = obj(tr.latency_s) || {};
    const active = num(pool.links_active);
    const idle = num(pool.links_idle);
    return {
      pool_links: active === null && idle === null ? null : (active || 0) + (idle || 0),
      tensors: num(store.tensors),
      store_bytes: num(store.bytes),
      in_bytes_per_s: num(tp.in_bytes_per_s),
      out_bytes_per_s: num(tp.out_bytes_per_s),
      in_bytes_total: num(tp.in_bytes_total),
      out_bytes_total: num(tp.out_bytes_total),
      latency_p50_s: num(lat.p50),
      latency_p99_s: num(lat.p99),
      metrics_url: null,
      age_s: 0,
      links: links(b.links),
    };
  }

  /** Pooled links as `{ peer, channel }`, bounded whatever the API sends: the status API
   * names them as hex and `shm`; a heartbeat's figures (members' rows) carry the node id as
   * its 32 bytes and the channel as its variant name (`Shm`). */
  function links(v) {
    return arr(v, MAX_NODES).map(obj).filter(Boolean)
      .map((l) => ({ peer: peerId(l.peer), channel: str(l.channel).toLowerCase() || "?" }));
  }

  /** A node id as hex, from hex or from an array of 32 bytes. */
  function peerId(v) {
    if (typeof v === "string") return v;
    const bytes = arr(v, 32);
    if (bytes.length !== 32) return "";
    return bytes.map((b) => {
      const n = num(b);
      return n === null || n < 0 || n > 255 ? "??" : n.toString(16).padStart(2, "0");
    }).join("");
  }

  function memberStats(s) {
    const o = obj(s);
    if (!o) return null;
    return {
      pool_links: num(o.pool_links),
      tensors: num(o.tensors),
      store_bytes: num(o.store_bytes),
      in_bytes_per_s: num(o.in_bytes_per_s),
      out_bytes_per_s: num(o.out_bytes_per_s),
      in_bytes_total: num(o.in_bytes_total),
      out_bytes_total: num(o.out_bytes_total),
      latency_p50_s: num(o.latency_p50_s),
      latency_p99_s: num(o.latency_p99_s),
      metrics_url: str(o.metrics_url) || null,
      age_s: num(o.age_s),
      links: links(o.links),
    };
  }

  /** The cluster JSON as a list of nodes (this broker first) plus the registry. */
  function model(data) {
    const root = obj(data);
    if (!root) throw new Error("the API answered something that is not a JSON object");
    const b = obj(root.broker) || {};
    const selfId = str(b.node_id);
    const nodes = [];
    const self = {
      id: selfId,
      role: str(b.role) || "broker",
      alive: true,
      self: true,
      addrs: arr(b.addrs, 16).map(str),
      epoch: null,
      stats: brokerStats(b),
    };
    nodes.push(self);
    for (const m of arr(root.members, MAX_NODES)) {
      const mo = obj(m);
      if (!mo) continue;
      const id = str(mo.node_id);
      if (id && id === selfId) {
        self.epoch = num(mo.epoch);
        if (!self.addrs.length) self.addrs = arr(mo.addrs, 16).map(str);
        continue;
      }
      nodes.push({
        id,
        role: str(mo.role) || "node",
        alive: mo.alive === true,
        self: false,
        addrs: arr(mo.addrs, 16).map(str),
        epoch: num(mo.epoch),
        stats: memberStats(mo.stats),
      });
    }
    const entries = [];
    for (const e of arr(root.entries, 100000)) {
      const eo = obj(e);
      if (!eo) continue;
      entries.push({
        name: str(eo.name),
        version: num(eo.version),
        dtype: str(eo.dtype),
        shape: arr(eo.shape, 32).map((d) => num(d)),
        byte_len: num(eo.byte_len),
        holders: arr(eo.holders, 4096).map(str),
        publisher: str(eo.publisher),
      });
    }
    entries.sort((a, b2) => (a.name < b2.name ? -1 : a.name > b2.name ? 1 :
      (b2.version || 0) - (a.version || 0)));
    // Totals of the whole registry (the entries are its first page only); an older broker
    // without them: count the entries listed.
    const reg = obj(root.registry);
    const totals = reg ? { names: num(reg.names), copies: num(reg.copies), bytes: num(reg.bytes) } :
      { names: null, copies: null, bytes: null };
    if (totals.names === null) totals.names = new Set(entries.map((e) => e.name)).size;
    if (totals.copies === null) totals.copies = entries.reduce((t, e) => t + e.holders.length, 0);
    if (totals.bytes === null) totals.bytes = entries.reduce((t, e) => t + (e.byte_len || 0), 0);
    const more = typeof root.next === "string" && root.next !== "";
    // Remote functions and their live servers (an older broker: none).
    const functions = [];
    for (const f of arr(root.functions, 1000)) {
      const fo = obj(f);
      if (!fo) continue;
      // Call figures summed over the servers whose heartbeats reported them (null from an
      // older broker, or before any server reported).
      const reporting = num(fo.reporting);
      const figure = (v) => (reporting ? num(v) : null);
      functions.push({
        name: str(fo.name),
        servers: arr(fo.servers, 64).map(str),
        callsPerS: figure(fo.calls_per_s),
        inFlight: figure(fo.in_flight),
        calls: figure(fo.calls_total),
        failed: figure(fo.failed_total),
      });
    }
    functions.sort((a, b2) => (a.name < b2.name ? -1 : a.name > b2.name ? 1 : 0));
    return { broker: b, self, nodes, entries, totals, more, functions };
  }

  // ---- summary ---------------------------------------------------------------------------
  function sum(nodes, field) {
    let total = null;
    for (const n of nodes) {
      const v = n.stats ? n.stats[field] : null;
      if (v !== null) total = (total || 0) + v;
    }
    return total;
  }

  function renderSummary(m) {
    const count = (role, alive) => m.nodes.filter((n) => (n.role === "broker") === (role === "broker") &&
      n.alive === alive).length;
    setText('[data-sum="brokers_alive"]', count("broker", true));
    setText('[data-sum="brokers_dead"]', count("broker", false));
    setText('[data-sum="workers_alive"]', count("worker", true));
    setText('[data-sum="workers_dead"]', count("worker", false));
    $("sum-brokers").classList.toggle("warn", count("broker", false) > 0);
    $("sum-workers").classList.toggle("warn", count("worker", false) > 0);

    setText('[data-sum="names"]', m.totals.names);
    setText('[data-sum="copies"]', m.totals.copies);
    setText('[data-sum="bytes_held"]', bytes(sum(m.nodes, "store_bytes")));
    setText('[data-sum="bytes_unique"]', bytes(m.totals.bytes));
    setText('[data-sum="in_bytes_per_s"]', rate(sum(m.nodes, "in_bytes_per_s")));
    setText('[data-sum="out_bytes_per_s"]', rate(sum(m.nodes, "out_bytes_per_s")));
    setText('[data-sum="in_bytes_total"]', bytes(sum(m.nodes, "in_bytes_total")));
    setText('[data-sum="out_bytes_total"]', bytes(sum(m.nodes, "out_bytes_total")));

    $("broker-id").textContent = shortId(m.self.id);
    $("broker-id").title = m.self.id;
    $("broker-version").textContent = str(m.broker.version) || "—";
    $("broker-uptime").textContent = uptime(num(m.broker.uptime_s));
  }

  // ---- colours per node: stable for the life of the page ---------------------------------
  const nodeColors = new Map();
  function colorOf(id) {
    if (!nodeColors.has(id)) nodeColors.set(id, PALETTE[nodeColors.size % PALETTE.length]);
    return nodeColors.get(id);
  }

  // ---- nodes table -----------------------------------------------------------------------
  function statCell(n, field, text) {
    const v = n.stats ? n.stats[field] : null;
    return el("td", {
      class: "num",
      "data-node": n.id,
      "data-field": field,
      "data-value": v === null ? "" : String(v),
    }, v === null ? "—" : text(v));
  }

  /** The channels of a node's pooled links, `quic×2 shm×1`; each peer in the title. */
  function channelsCell(n) {
    const ls = n.stats ? n.stats.links : [];
    const counts = new Map();
    for (const l of ls) counts.set(l.channel, (counts.get(l.channel) || 0) + 1);
    const text = [...counts].map(([c, k]) => c + "×" + k).join(" ");
    return el("td", {
      class: "mono",
      "data-node": n.id,
      "data-field": "channels",
      "data-value": ls.map((l) => l.peer + "=" + l.channel).join(" "),
      title: ls.map((l) => shortId(l.peer) + " " + l.channel).join("\n"),
    }, text || "—");
  }

  function renderNodes(m) {
    const rows = m.nodes.map((n) => {
      const s = n.stats;
      const idCell = el("td", { class: "mono node-id", title: n.id },
        el("span", { class: "swatch", style: "background:" + colorOf(n.id) }),
        shortId(n.id), n.self ? el("span", { class: "tag", title: "the broker serving this page" }, "this") : null);
      const metrics = n.self ? safeUrl("metrics") : s && s.metrics_url ?
        safeUrl(s.metrics_url.replace(/\/+$/, "") + "/metrics") : null;
      const age = n.self ? "live figures from this broker" : s && s.age_s !== null ?
        "figures from a heartbeat " + s.age_s.toFixed(1) + " s ago" : n.role === "broker" ?
        "another broker: its figures are on its own dashboard" :
        "no figures here: it heartbeats to another broker";
      return el("tr", { "data-node-row": n.id, "data-alive": String(n.alive), class: n.alive ? "" : "dead" },
        idCell,
        el("td", {}, el("span", { class: "role role-" + (n.role === "broker" ? "broker" : "worker") }, n.role)),
        el("td", { "data-node": n.id, "data-field": "alive", title: age },
          el("span", { class: "live " + (n.alive ? "up" : "down") }), n.alive ? "alive" : "dead"),
        el("td", { class: "mono addrs" }, n.addrs.length ? n.addrs.join(", ") : "—"),
        statCell(n, "pool_links", String),
        channelsCell(n),
        statCell(n, "tensors", String),
        statCell(n, "store_bytes", bytes),
        statCell(n, "in_bytes_per_s", rate),
        statCell(n, "out_bytes_per_s", rate),
        statCell(n, "in_bytes_total", bytes),
        statCell(n, "out_bytes_total", bytes),
        statCell(n, "latency_p50_s", seconds),
        statCell(n, "latency_p99_s", seconds),
        el("td", {}, metrics ? el("a", { href: metrics.href, target: "_blank", rel: "noopener" },
          "/metrics") : el("span", { class: "muted" }, "—")));
    });
    $("nodes-body").replaceChildren(...rows);
    $("nodes-count").textContent = "· " + m.nodes.length;
  }

  // ---- latency panel ---------------------------------------------------------------------
  function renderLatency(m) {
    const withLat = m.nodes.filter((n) => n.stats &&
      (n.stats.latency_p50_s !== null || n.stats.latency_p99_s !== null));
    const box = $("latency");
    if (!withLat.length) {
      box.replaceChildren(el("div", { class: "empty" }, "No transfers measured yet."));
    } else {
      const max = Math.max(...withLat.map((n) => Math.max(n.stats.latency_p99_s || 0,
        n.stats.latency_p50_s || 0)), 1e-9);
      const bar = (cls, v) => el("div", { class: "bar " + cls,
        style: "width:" + (v === null ? 0 : Math.max(1, (100 * v) / max)).toFixed(1) + "%" });
      box.replaceChildren(...withLat.map((n) => el("div", { class: "lat-row", "data-latency": n.id },
        el("div", { class: "lat-name mono", title: n.id },
          el("span", { class: "swatch", style: "background:" + colorOf(n.id) }), shortId(n.id)),
        el("div", { class: "bars" }, bar("p50", n.stats.latency_p50_s), bar("p99", n.stats.latency_p99_s)),
        el("div", { class: "lat-vals num" },
          el("span", { "data-node": n.id, "data-field": "p50" }, seconds(n.stats.latency_p50_s)),
          el("span", { class: "muted" }, " / "),
          el("span", { "data-node": n.id, "data-field": "p99" }, seconds(n.stats.latency_p99_s))))));
    }
    const tr = obj(m.broker.transfers) || {};
    const lat = obj(tr.latency_s) || {};
    const kv = (k, v) => el("div", { class: "kv" }, el("span", { class: "muted" }, k), el("span", {}, v));
    $("broker-transfers").replaceChildren(
      el("div", { class: "kv-title muted" }, "this broker's transfers"),
      kv("in flight", String(num(tr.in_flight) ?? "—")),
      kv("ok", String(num(tr.ok) ?? "—")),
      kv("errors", String(num(tr.errors) ?? "—")),
      kv("p90", seconds(num(lat.p90))));
  }

  // ---- registry --------------------------------------------------------------------------
  let lastEntriesKey = null;
  let lastFilter = null;

  function renderRegistry(m, force) {
    const filter = $("registry-filter").value.trim().toLowerCase();
    const alive = new Map(m.nodes.map((n) => [n.id, n.alive]));
    const key = JSON.stringify(m.entries) + "|" + JSON.stringify([...alive]);
    if (!force && key === lastEntriesKey && filter === lastFilter) return;
    lastEntriesKey = key;
    lastFilter = filter;

    const matches = filter ? m.entries.filter((e) => e.name.toLowerCase().includes(filter) ||
      e.dtype.toLowerCase().includes(filter) ||
      e.holders.some((h) => h.toLowerCase().startsWith(filter))) : m.entries;
    const shown = matches.slice(0, MAX_ROWS);
    const rows = shown.map((e) => {
      const holders = el("td", { class: "holders" },
        el("span", { class: "count", "data-field": "holders" }, String(e.holders.length)),
        ...e.holders.slice(0, 8).map((h) => el("span", {
          class: "chip mono" + (alive.get(h) === false ? " gone" : alive.has(h) ? "" : " stranger"),
          title: h + (alive.get(h) === false ? " (dead)" : alive.has(h) ? "" :
            " (not a member this broker knows: a client that fetched it?)"),
        }, el("span", { class: "swatch", style: "background:" + colorOf(h) }), shortId(h))),
        e.holders.length > 8 ? el("span", { class: "muted" }, " +" + (e.holders.length - 8)) : null);
      const shape = "[" + e.shape.map((d) => (d === null ? "?" : String(d))).join(", ") + "]";
      return el("tr", { "data-tensor": e.name, "data-version": e.version === null ? "" : String(e.version) },
        el("td", { class: "name mono", title: e.name }, e.name),
        el("td", { class: "num" }, e.version === null ? "—" : "v" + e.version),
        el("td", {}, el("span", { class: "dtype" }, e.dtype || "?")),
        el("td", { class: "mono" }, shape),
        el("td", { class: "num", "data-field": "byte_len", "data-value": String(e.byte_len ?? "") },
          bytes(e.byte_len)),
        holders,
        el("td", { class: "mono muted", title: e.publisher }, shortId(e.publisher)));
    });
    $("registry-body").replaceChildren(...rows);
    const empty = $("registry-empty");
    if (!m.entries.length) {
      empty.hidden = false;
      empty.textContent = "The registry is empty: publish a tensor with `tb put NAME FILE`.";
    } else if (!matches.length) {
      empty.hidden = false;
      empty.textContent = "No tensor matches this filter.";
    } else {
      empty.hidden = true;
    }
    $("registry-count").textContent = "· " + (filter ? matches.length + " of " : "") + m.entries.length +
      (m.more ? " listed of " + m.totals.names + " names" : "") +
      (matches.length > shown.length ? " (first " + shown.length + " shown)" : "");
  }

  // ---- remote functions ------------------------------------------------------------------
  let lastFunctionsKey = null;

  function renderFunctions(m) {
    const alive = new Map(m.nodes.map((n) => [n.id, n.alive]));
    const key = JSON.stringify(m.functions) + "|" + JSON.stringify([...alive]);
    if (key === lastFunctionsKey) return;
    lastFunctionsKey = key;
    const rows = m.functions.slice(0, MAX_ROWS).map((f) => el("tr", { "data-function": f.name },
      el("td", { class: "name mono", title: f.name }, f.name),
      el("td", { class: "num", "data-field": "servers" }, String(f.servers.length)),
      el("td", { class: "num", "data-field": "calls-per-s" }, callRate(f.callsPerS)),
      el("td", { class: "num", "data-field": "in-flight" }, tally(f.inFlight)),
      el("td", { class: "num", "data-field": "calls" }, tally(f.calls)),
      el("td", { class: "num", "data-field": "failed" }, tally(f.failed)),
      el("td", { class: "holders" }, ...f.servers.slice(0, 16).map((id) => el("span", {
        class: "chip mono" + (alive.get(id) === false ? " gone" : ""),
        title: id,
      }, el("span", { class: "swatch", style: "background:" + colorOf(id) }), shortId(id))),
      f.servers.length > 16 ? el("span", { class: "muted" }, " +" + (f.servers.length - 16)) : null)));
    $("functions-body").replaceChildren(...rows);
    const empty = $("functions-empty");
    empty.hidden = m.functions.length > 0;
    empty.textContent = "No function is served: share one with @client.share(NAME) and serve it.";
    $("functions-count").textContent = "· " + m.functions.length;
  }

  // ---- throughput history and chart ------------------------------------------------------
  const samples = []; // { t, nodes: Map(id -> {in, out}) }, oldest first
  let mode = "total";
  let chart = null;
  let chartKey = "";

  function record(m) {
    const t = Date.now() / 1000;
    const nodes = new Map();
    for (const n of m.nodes) {
      if (!n.stats) continue;
      nodes.set(n.id, { in: n.stats.in_bytes_per_s, out: n.stats.out_bytes_per_s });
    }
    samples.push({ t, nodes });
    while (samples.length && samples[0].t < t - HISTORY_S) samples.shift();
  }

  function seriesPlan() {
    if (mode === "total") {
      return [
        { label: "in", stroke: IN_COLOR, fill: "rgba(52,211,153,0.12)", pick: (s) => total(s, "in") },
        { label: "out", stroke: OUT_COLOR, fill: "rgba(129,140,248,0.12)", pick: (s) => total(s, "out") },
      ];
    }
    const ids = [];
    for (const s of samples) for (const id of s.nodes.keys()) if (!ids.includes(id)) ids.push(id);
    const plan = [];
    for (const id of ids.slice(0, 24)) {
      plan.push({ label: shortId(id) + " in", stroke: colorOf(id), pick: (s) => val(s, id, "in") });
      plan.push({ label: shortId(id) + " out", stroke: colorOf(id), dash: [6, 4], pick: (s) => val(s, id, "out") });
    }
    return plan;
  }

  function total(sample, dir) {
    let t = null;
    for (const v of sample.nodes.values()) if (v[dir] !== null) t = (t || 0) + v[dir];
    return t;
  }

  function val(sample, id, dir) {
    const v = sample.nodes.get(id);
    return v ? v[dir] : null;
  }

  function axisColor() {
    return { stroke: "#94a3b8", grid: { stroke: "rgba(148,163,184,0.12)", width: 1 },
      ticks: { stroke: "rgba(148,163,184,0.25)", width: 1 } };
  }

  function renderChart() {
    const box = $("chart");
    if (typeof window.uPlot !== "function") {
      box.replaceChildren(el("div", { class: "empty" }, "chart library failed to load"));
      return;
    }
    const plan = seriesPlan();
    const data = [samples.map((s) => s.t), ...plan.map((p) => samples.map((s) => p.pick(s)))];
    const key = mode + "|" + plan.map((p) => p.label).join(",");
    const width = Math.max(300, box.clientWidth || 600);
    if (!chart || key !== chartKey) {
      if (chart) chart.destroy();
      box.replaceChildren();
      chartKey = key;
      chart = new window.uPlot({
        width,
        height: CHART_HEIGHT,
        cursor: { drag: { x: false, y: false } },
        legend: { live: true },
        scales: { x: { time: true, range: (u, min, max) => [max - HISTORY_S, max] }, y: { range: (u, min, max) => [0, Math.max(max * 1.15, 1024)] } },
        axes: [
          Object.assign(axisColor(), {}),
          Object.assign(axisColor(), { size: 78, values: (u, ticks) => ticks.map((v) => rate(v)) }),
        ],
        series: [
          { value: (u, v) => (v === null ? "—" : new Date(v * 1000).toLocaleTimeString()) },
          ...plan.map((p) => ({
            label: p.label,
            stroke: p.stroke,
            fill: p.fill,
            dash: p.dash,
            width: 2,
            spanGaps: false,
            points: { show: false },
            value: (u, v) => rate(v),
          })),
        ],
      }, data, box);
    } else {
      chart.setData(data);
      if (Math.abs(chart.width - width) > 1) chart.setSize({ width, height: CHART_HEIGHT });
    }
    // With the cursor off the chart, the legend shows the newest values instead of dashes.
    if (samples.length && !(chart.cursor && chart.cursor.left >= 0)) {
      chart.setLegend({ idx: samples.length - 1 });
    }
    box.dataset.samples = String(samples.length);
  }

  function setMode(next) {
    mode = next;
    for (const [id, m] of [["mode-total", "total"], ["mode-nodes", "nodes"]]) {
      $(id).classList.toggle("on", m === mode);
      $(id).setAttribute("aria-pressed", String(m === mode));
    }
    renderChart();
  }

  // ---- connection state and polling -------------------------------------------------------
  let lastOk = null;
  let failures = 0;
  let polls = 0;
  let current = null;

  function setConn(state, text) {
    document.body.dataset.state = state;
    $("conn").dataset.conn = state;
    $("conn-text").textContent = text;
  }

  function onSuccess(data) {
    const m = model(data);
    current = m;
    polls += 1;
    failures = 0;
    lastOk = Date.now();
    document.body.dataset.polls = String(polls);
    $("banner").hidden = true;
    $("insecure").hidden = !(data.broker && data.broker.insecure_open);
    setConn("live", "live · updated " + new Date(lastOk).toLocaleTimeString());
    record(m);
    renderSummary(m);
    renderNodes(m);
    renderLatency(m);
    renderRegistry(m, false);
    renderFunctions(m);
    renderChart();
  }

  function onFailure(err) {
    failures += 1;
    const retryMs = Math.min(RETRY_MAX_MS, POLL_MS * 2 ** Math.min(failures - 1, 3));
    const since = lastOk === null ? "no data received yet" :
      "showing data from " + Math.round((Date.now() - lastOk) / 1000) + " s ago";
    setConn("disconnected", "disconnected");
    $("banner").hidden = false;
    $("banner-text").textContent = "Cannot reach " + API + " (" + (err && err.message ? err.message : err) +
      "). Retrying in " + Math.round(retryMs / 1000) + " s, attempt " + failures + "; " + since + ".";
    return retryMs;
  }

  // ---- the API's bearer token -------------------------------------------------------------
  function storedToken() {
    try {
      return window.sessionStorage.getItem(TOKEN_KEY) || "";
    } catch (_) {
      return "";
    }
  }

  function storeToken(t) {
    try {
      if (t) window.sessionStorage.setItem(TOKEN_KEY, t);
      else window.sessionStorage.removeItem(TOKEN_KEY);
    } catch (_) {
      // No storage (a sandboxed page): the token lives as long as this page.
    }
  }

  // `#token=...` (alone, or with `per-node`: `#per-node&token=...`): taken, then removed from
  // the address bar so it is neither shown, bookmarked nor shared along with a link. Parsed
  // by hand: a base64 token's `+` must stay a `+` (URLSearchParams would make it a space).
  const hashParts = window.location.hash.replace(/^#/, "").split("&").filter(Boolean);
  const tokenPart = hashParts.find((p) => p.startsWith("token="));
  let token = storedToken();
  if (tokenPart !== undefined) {
    const raw = tokenPart.slice("token=".length);
    try {
      token = decodeURIComponent(raw).trim();
    } catch (_) {
      token = raw.trim();
    }
    storeToken(token);
    const rest = hashParts.filter((p) => !p.startsWith("token=")).join("&");
    history.replaceState(null, "", window.location.pathname + window.location.search +
      (rest ? "#" + rest : ""));
  }
  // The token form, made once, shown in the banner while the API answers 401.
  let tokenForm = null;

  function showTokenForm(show) {
    if (!show) {
      if (tokenForm) tokenForm.hidden = true;
      return;
    }
    if (!tokenForm) {
      const input = el("input", { type: "password", id: "token-input", autocomplete: "off",
        placeholder: "HTTP token", style: "min-width:22em" });
      tokenForm = el("form", { id: "token-form", style: "margin-top:8px;display:flex;gap:8px" },
        input, el("button", { type: "submit" }, "Use token"));
      tokenForm.addEventListener("submit", (ev) => {
        ev.preventDefault();
        const t = input.value.trim();
        if (!t) return;
        token = t;
        storeToken(t);
        input.value = "";
        pollNow();
      });
      $("banner").append(tokenForm);
    }
    tokenForm.hidden = false;
  }

  let polling = false;
  let pollSoon = false;
  let pollTimer = null;

  /** Polls at once (or right after the poll under way). */
  function pollNow() {
    if (polling) {
      pollSoon = true;
      return;
    }
    clearTimeout(pollTimer);
    poll();
  }

  async function poll() {
    polling = true;
    const ctrl = new AbortController();
    const timer = setTimeout(() => ctrl.abort(), FETCH_TIMEOUT_MS);
    let next = POLL_MS;
    try {
      const headers = { Accept: "application/json" };
      if (token) headers.Authorization = "Bearer " + token;
      const resp = await fetch(API + "?limit=" + PAGE_LIMIT, { cache: "no-store", signal: ctrl.signal,
        headers });
      if (resp.status === 404) {
        throw new Error("HTTP 404: this process has no cluster view, only brokers do; open a broker's dashboard");
      }
      showTokenForm(resp.status === 401);
      if (resp.status === 401) {
        throw new Error("HTTP 401: this broker's API needs its token (--http-token-file): " +
          "enter it below, or open the page as " + window.location.pathname + "#token=TOKEN");
      }
      if (!resp.ok) throw new Error("HTTP " + resp.status);
      const data = await resp.json();
      try {
        onSuccess(data);
      } catch (err) {
        // The API answered but the page could not show it: say so rather than "disconnected".
        console.error(err);
        $("banner").hidden = false;
        $("banner-text").textContent = "The page could not show the API's answer: " + err;
      }
    } catch (err) {
      next = onFailure(err && err.name === "AbortError" ? new Error("timed out") : err);
    } finally {
      clearTimeout(timer);
      polling = false;
      pollTimer = setTimeout(poll, pollSoon ? 0 : next);
      pollSoon = false;
    }
  }

  $("registry-filter").addEventListener("input", () => {
    if (current) renderRegistry(current, true);
  });
  $("mode-total").addEventListener("click", () => setMode("total"));
  $("mode-nodes").addEventListener("click", () => setMode("nodes"));
  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(renderChart, 100);
  });

  // `#per-node` in the address opens the chart per node (a link people can share).
  if (hashParts.includes("per-node")) setMode("nodes");
  poll();
})();
