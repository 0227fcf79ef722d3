// The headwatch tab of TensorBoard: one self-contained ES module (no library, nothing from the network).
// TensorBoard loads it in an iframe and calls render(); the data comes from the plugin's own routes
// (relative to the iframe's base, /data/plugin/headwatch/). Every series is drawn unsmoothed: lines
// through the logged points, and the points themselves where a series is sparse.

const COLORS = ['#1f77b4', '#d62728', '#2ca02c', '#9467bd', '#ff7f0e', '#8c564b', '#17becf'];
const SPARSE = 40; // a series with at most this many points shows each point
const W = 460, H = 230, M = {l: 58, r: 12, t: 10, b: 30};
const SVG = 'http://www.w3.org/2000/svg';
const state = {runs: [], chosen: null, hostRuns: null, verdicts: false, measurement: {}, busy: false, filter: null};

// ------------------------------------------------------------------ TensorBoard's plugin messages
// The frame TensorBoard puts a plugin in answers 'experimental.GetRuns' and sends
// 'experimental.RunsChanged' / 'experimental.DataReloaded' over a MessagePort it receives with
// 'experimental.bootstrap'. Opened alone, nobody answers: the page then reloads on its own timer.
function connectHost() {
  if (window.parent === window) return null;
  const channel = new MessageChannel();
  const waits = new Map(), listeners = new Map();
  let id = 0;
  channel.port1.onmessage = async (event) => {
    const m = JSON.parse(event.data);
    if (m.isReply) {
      const w = waits.get(m.id);
      if (w) { waits.delete(m.id); m.error ? w.reject(new Error(m.error)) : w.resolve(m.payload); }
      return;
    }
    let payload = null, error = null;
    try { payload = listeners.has(m.type) ? await listeners.get(m.type)(m.payload) : null; } catch (e) { error = String(e); }
    channel.port1.postMessage(JSON.stringify({type: m.type, id: m.id, payload, error, isReply: true}));
  };
  window.parent.postMessage('experimental.bootstrap', '*', [channel.port2]);
  return {
    send(type, payload = null) {
      const mine = id++;
      channel.port1.postMessage(JSON.stringify({type, id: mine, payload, error: null, isReply: false}));
      return new Promise((resolve, reject) => waits.set(mine, {resolve, reject}));
    },
    listen(type, callback) { listeners.set(type, callback); },
  };
}

const within = (promise, ms) => Promise.race([promise, new Promise((r) => setTimeout(() => r(undefined), ms))]);

async function getJSON(route) {
  const response = await fetch(route);
  if (!response.ok) throw new Error(`${route}: HTTP ${response.status}`);
  return response.json();
}

// ------------------------------------------------------------------ small DOM and number helpers
function el(tag, attrs = {}, ...children) {
  const node = tag.startsWith('svg:') ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) if (v !== undefined && v !== null) node.setAttribute(k, v);
  for (const c of children.flat()) if (c !== null && c !== undefined) node.append(c instanceof Node ? c : String(c));
  return node;
}

function fmt(v) {
  if (v === null || v === undefined) return '—';
  if (typeof v !== 'number') return String(v);
  if (v === 0) return '0';
  const a = Math.abs(v);
  return (a >= 1e5 || a < 1e-3) ? v.toExponential(3) : String(Number(v.toPrecision(4)));
}

function ticks(lo, hi, n = 5) {
  const span = hi - lo || Math.abs(hi) || 1, raw = span / n, mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((k) => k * mag).find((s) => s >= raw);
  const out = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(Number(t.toPrecision(12)));
  return out;
}

// ------------------------------------------------------------------ one chart of one vital sign, one run
function extent(panels) {
  let xs = [Infinity, -Infinity], ys = [Infinity, -Infinity];
  for (const p of panels) {
    for (const s of p.series) for (const [x, y] of s.points) {
      xs = [Math.min(xs[0], x), Math.max(xs[1], x)];
      if (y !== null) ys = [Math.min(ys[0], y), Math.max(ys[1], y)];
    }
    if (p.reference) ys = [Math.min(ys[0], p.reference.value), Math.max(ys[1], p.reference.value)];
  }
  if (!isFinite(xs[0])) xs = [0, 1];
  if (!isFinite(ys[0])) ys = [0, 1];
  if (xs[0] === xs[1]) xs = [xs[0] - 1, xs[1] + 1];
  const pad = (ys[1] - ys[0]) * 0.06 || Math.abs(ys[0]) * 0.1 || 0.5;
  return {x: xs, y: [ys[0] - pad, ys[1] + pad]};
}

function chart(panel, run, box) {
  const sx = (x) => M.l + (x - box.x[0]) / (box.x[1] - box.x[0]) * (W - M.l - M.r);
  const sy = (y) => H - M.b - (y - box.y[0]) / (box.y[1] - box.y[0]) * (H - M.t - M.b);
  const svg = el('svg:svg', {viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: 'img',
    'aria-label': `${panel.title}, ${run}`});
  for (const t of ticks(box.y[0], box.y[1])) {
    svg.append(el('svg:line', {x1: M.l, x2: W - M.r, y1: sy(t), y2: sy(t), class: 'grid'}));
    svg.append(el('svg:text', {x: M.l - 6, y: sy(t) + 4, class: 'tick', 'text-anchor': 'end'}, fmt(t)));
  }
  for (const t of ticks(box.x[0], box.x[1], 6).filter((t) => Number.isInteger(t))) {
    svg.append(el('svg:line', {x1: sx(t), x2: sx(t), y1: H - M.b, y2: H - M.b + 4, class: 'axis'}));
    svg.append(el('svg:text', {x: sx(t), y: H - M.b + 16, class: 'tick', 'text-anchor': 'middle'}, fmt(t)));
  }
  svg.append(el('svg:text', {x: W - M.r, y: H - 2, class: 'tick', 'text-anchor': 'end'}, 'step'));
  svg.append(el('svg:line', {x1: M.l, x2: W - M.r, y1: H - M.b, y2: H - M.b, class: 'axis'}));
  svg.append(el('svg:line', {x1: M.l, x2: M.l, y1: M.t, y2: H - M.b, class: 'axis'}));
  const legend = el('ul', {class: 'legend'});
  if (panel.reference) {
    const y = sy(panel.reference.value);
    svg.append(el('svg:line', {x1: M.l, x2: W - M.r, y1: y, y2: y, class: 'constant'}));
    legend.append(el('li', {'data-label': panel.reference.label}, el('span', {class: 'swatch constant'}), panel.reference.label));
  }
  const low = panel.series.find((s) => s.style === 'band_low'), high = panel.series.find((s) => s.style === 'band_high');
  let color = 0;
  const colorOf = new Map();
  for (const s of panel.series) if (!s.style.startsWith('band')) colorOf.set(s, COLORS[color++ % COLORS.length]);
  if (low && high) {
    const top = new Map(high.points.filter((p) => p[1] !== null)), first = colorOf.get(panel.series[0]);
    const pts = low.points.filter((p) => p[1] !== null && top.has(p[0]));
    if (pts.length) {
      const d = pts.map(([x, y]) => `${sx(x)},${sy(y)}`).concat(pts.slice().reverse().map(([x]) => `${sx(x)},${sy(top.get(x))}`));
      svg.append(el('svg:polygon', {points: d.join(' '), class: 'band', fill: first, 'data-label': `${low.label}-${high.label}`}));
      legend.append(el('li', {'data-label': `${low.label}-${high.label} band`}, el('span', {class: 'swatch band', style: `background:${first}`}),
        `${low.label}-${high.label} band (${low.tag.split('/').pop()}, ${high.tag.split('/').pop()})`));
    }
  }
  for (const s of panel.series) {
    if (s.style.startsWith('band')) continue;
    const c = colorOf.get(s), sparse = s.style === 'points' || s.points.length <= SPARSE;
    let d = '', pen = false;
    for (const [x, y] of s.points) {
      if (y === null) { pen = false; continue; }
      d += `${pen ? 'L' : 'M'}${sx(x).toFixed(1)},${sy(y).toFixed(1)}`;
      pen = true;
    }
    const g = el('svg:g', {class: `series ${s.style}`, 'data-label': s.label, 'data-tag': s.tag});
    g.append(el('svg:path', {d, stroke: c, class: s.style === 'reference' ? 'line dashed' : 'line'}));
    if (sparse) for (const [x, y] of s.points) if (y !== null) {
      g.append(el('svg:circle', {cx: sx(x), cy: sy(y), r: 2.8, fill: c, 'data-step': x, 'data-value': y},
        el('svg:title', {}, `${s.label}: ${fmt(y)} at step ${x}`)));
    }
    svg.append(g);
    const last = s.points.filter((p) => p[1] !== null).pop();
    legend.append(el('li', {'data-label': s.label, title: s.tag},
      el('span', {class: `swatch ${s.style === 'reference' ? 'dashed' : ''}`, style: `border-color:${c};background:${sparse ? c : 'transparent'}`}),
      `${s.label}`, el('span', {class: 'last'}, last ? ` ${fmt(last[1])} at step ${last[0]}` : ' no finite value')));
  }
  return el('figure', {class: 'chart', 'data-panel': panel.key, 'data-run': run},
    el('figcaption', {}, run), svg, legend);
}

// ------------------------------------------------------------------ sections
function vitalSection(byRun) {
  const out = el('section', {id: 'vitals'}, el('h2', {}, 'Vital signs'));
  const keys = byRun.length ? byRun[0].panels.map((p) => p.key) : [];
  for (const key of keys) {
    const panels = byRun.map((v) => v.panels.find((p) => p.key === key));
    const head = panels[0];
    const row = el('div', {class: 'row'});
    const steps = extent(panels).x; // one step axis for every run; each run's own value axis
    byRun.forEach((v, i) => row.append(panels[i].series.length ? chart(panels[i], v.run, {x: steps, y: extent([panels[i]]).y})
      : el('figure', {class: 'chart empty', 'data-panel': key, 'data-run': v.run}, el('figcaption', {}, v.run), 'not recorded by this run')));
    out.append(el('div', {class: 'panel', 'data-panel': key},
      el('h3', {}, `${head.title} (${head.unit})`), el('p', {class: 'note'}, head.note), row));
  }
  return out;
}

function alertSection(all) {
  const out = el('section', {id: 'alerts'}, el('h2', {}, 'Alerts'));
  for (const a of all) {
    const end = Math.max(a.last_step ?? 0, ...a.alerts.map((x) => x.step), 1);
    const tw = 920, th = 44, sx = (s) => 20 + s / end * (tw - 40);
    const svg = el('svg:svg', {viewBox: `0 0 ${tw} ${th}`, width: tw, height: th, class: 'timeline'});
    svg.append(el('svg:line', {x1: 20, x2: tw - 20, y1: 26, y2: 26, class: 'axis'}));
    for (const t of ticks(0, end, 10).filter((t) => Number.isInteger(t) && t >= 0)) {
      svg.append(el('svg:text', {x: sx(t), y: 42, class: 'tick', 'text-anchor': 'middle'}, fmt(t)));
    }
    for (const x of a.alerts) {
      svg.append(el('svg:path', {d: `M${sx(x.step)},24 l-6,-12 h12 z`, class: `marker ${x.severity || 'unknown'}`, 'data-step': x.step},
        el('svg:title', {}, `step ${x.step}: ${x.rule ?? ''} (${x.severity ?? ''}) ${x.message ?? ''}`)));
    }
    const rows = a.alerts.map((x) => el('tr', {class: x.severity || ''}, el('td', {}, x.step), el('td', {}, x.rule ?? '—'),
      el('td', {}, x.severity ?? '—'), el('td', {class: 'message'}, x.message ?? el('span', {class: 'quiet'}, `(${x.note})`))));
    out.append(el('div', {class: 'run-alerts', 'data-run': a.run}, el('h3', {}, a.run),
      a.alerts.length ? [svg, el('table', {}, el('thead', {}, el('tr', {}, ['step', 'rule', 'severity', 'message'].map((h) => el('th', {}, h)))),
        el('tbody', {}, rows))] : el('p', {class: 'quiet'}, `no alert fired (steps 0 to ${a.last_step ?? '?'})`)));
  }
  return out;
}

function collisionSection(all) {
  const out = el('section', {id: 'collisions'}, el('h2', {}, 'Collision table: rare tokens and their nearest rows (drift removed)'));
  for (const c of all) {
    const box = el('div', {class: 'run-collisions', 'data-run': c.run}, el('h3', {}, c.run));
    if (!c.tables.length) { out.append(box); box.append(el('p', {class: 'quiet'}, 'no collision measurement yet')); continue; }
    const pick = el('select', {'aria-label': `measurement of ${c.run}`});
    c.tables.forEach((t, i) => pick.append(el('option', {value: i}, `step ${t.step}, ${t.matrix}: ${t.pairs.length} pairs`)));
    const chosen = Math.min(state.measurement[c.run] ?? 0, c.tables.length - 1);
    pick.value = String(chosen);
    const holder = el('div', {});
    const show = (i) => {
      state.measurement[c.run] = i;
      const t = c.tables[i];
      holder.replaceChildren(t.pairs.length ? el('table', {class: 'pairs', 'data-step': t.step, 'data-matrix': t.matrix},
        el('thead', {}, el('tr', {}, ['rare token', 'text', 'count', 'nearest row', 'text', 'count', 'cosine (drift removed)', 'raw cosine'].map((h) => el('th', {}, h)))),
        el('tbody', {}, t.pairs.map((p) => el('tr', {}, el('td', {}, p.token), el('td', {}, el('code', {class: 'token'}, JSON.stringify(p.text))), el('td', {}, p.count),
          el('td', {}, p.neighbour), el('td', {}, el('code', {class: 'token'}, JSON.stringify(p.neighbour_text))), el('td', {}, p.neighbour_count),
          el('td', {}, fmt(p.cosine)), el('td', {}, fmt(p.raw_cosine)))))) : el('p', {class: 'quiet'}, `no rare token collides at tau = ${t.tau}`),
        el('p', {class: 'note'}, t.note));
    };
    pick.onchange = () => show(Number(pick.value));
    show(chosen);
    box.append(pick, holder);
    out.append(box);
  }
  return out;
}

function verdictSection(answer) {
  const out = el('section', {id: 'verdicts'}, el('h2', {}, 'Verdicts: headwatch report'));
  if (!answer.available) return out.append(el('p', {class: 'quiet'}, answer.note)), out;
  const v = answer.verdicts;
  if (!v) return out.append(el('p', {class: 'quiet'}, (answer.notes || []).join(' '))), out;
  const sides = Object.keys(v.sides || {}), others = sides.filter((s) => s !== v.reference);
  out.append(el('p', {class: 'note'}, `${others.join(', ') || 'nothing'} against ${v.reference}`,
    v.one_run_a_side ? ': one run a side gives differences, no verdict (train seeds for verdicts)' : `; family-wise error ${v.alpha}`));
  const head = ['headline', ...sides.map((s) => `${s} (${(v.sides[s].runs || []).length} run${(v.sides[s].runs || []).length === 1 ? '' : 's'})`),
    ...others.map((s) => `${s} − ${v.reference} [interval]`), 'verdict'];
  const rows = (v.headlines || []).map((h) => {
    const comps = others.map((s) => (h.comparisons || {})[s] || {});
    const cells = comps.map((c) => c.cost ? (c.cost.parameters !== undefined && c.cost.parameters !== null
      ? `${fmt(c.cost.parameters)} parameters (${c.cost.vocab_size} x ${c.cost.d_model})` : (c.cost.why || '—'))
      : c.difference === undefined || c.difference === null ? (c.why || '—')
      : `${fmt(c.difference)}${c.interval ? ` [${fmt(c.interval.low)}, ${fmt(c.interval.high)}]` : ''}`);
    const words = comps.map((c) => c.verdict || c.why || '').filter(Boolean);
    return el('tr', {'data-key': h.key}, el('td', {}, `${h.question}${h.unit ? `, ${h.unit}` : ''}`),
      sides.map((s) => el('td', {}, fmt((h.means || {})[s]))), cells.map((c) => el('td', {}, c)), el('td', {}, words.join('; ')));
  });
  out.append(el('table', {class: 'verdicts'}, el('thead', {}, el('tr', {}, head.map((h) => el('th', {}, h)))), el('tbody', {}, rows)));
  for (const n of answer.notes || []) out.append(el('p', {class: 'quiet'}, n));
  return out;
}

// ------------------------------------------------------------------ the page
function runPicker(root) {
  const box = el('fieldset', {class: 'runs'}, el('legend', {}, 'runs'));
  for (const r of state.runs) {
    const input = el('input', {type: 'checkbox', value: r.run});
    input.checked = state.chosen.has(r.run);
    input.onchange = () => { input.checked ? state.chosen.add(r.run) : state.chosen.delete(r.run); refresh(root); };
    box.append(el('label', {}, input, ` ${r.run}`, el('span', {class: 'quiet'}, r.prefix === 'headwatch' ? '' : ` (${r.prefix}/)`)));
  }
  return box;
}

async function refresh(root) {
  if (state.busy) return;
  state.busy = true;
  try {
    const listing = await getJSON('runs');
    state.verdicts = listing.verdicts;
    const known = state.hostRuns ? new Set(state.hostRuns) : null;
    state.runs = listing.runs.filter((r) => !known || known.has(r.run));
    if (state.chosen === null) { // at first: every run, or those the `runs` regex of the URL matches
      let keep = () => true;
      try { if (state.filter) { const re = new RegExp(state.filter); keep = (name) => re.test(name); } } catch (e) { /* not a regex: every run */ }
      state.chosen = new Set(state.runs.map((r) => r.run).filter(keep));
    }
    const runs = state.runs.filter((r) => state.chosen.has(r.run)).map((r) => r.run);
    const q = (route, run) => getJSON(`${route}?run=${encodeURIComponent(run)}`);
    const [vitals, alerts, collisions, verdicts] = await Promise.all([
      Promise.all(runs.map((r) => q('vitals', r))), Promise.all(runs.map((r) => q('alerts', r))),
      Promise.all(runs.map((r) => q('collisions', r))),
      runs.length ? getJSON('verdicts?' + runs.map((r) => `run=${encodeURIComponent(r)}`).join('&')) : {available: true, verdicts: null, notes: ['no run chosen']},
    ]);
    const scroll = window.scrollY;
    root.replaceChildren(...[
      el('header', {}, el('h1', {}, 'headwatch'), el('p', {class: 'quiet'},
        'the embedding and the output head while the model trains; every point as logged (no smoothing)'), runPicker(root)),
      ...(state.runs.length ? [vitalSection(vitals), alertSection(alerts), collisionSection(collisions), verdictSection(verdicts)]
        : [el('p', {class: 'quiet'}, 'No run with headwatch tags yet: attach a headwatch callback, train, and reload.')]),
    ]);
    window.scrollTo(0, scroll);
    document.body.dataset.state = 'ready';
    document.body.dataset.runs = String(runs.length);
  } catch (err) {
    root.replaceChildren(el('p', {class: 'error'}, `headwatch: ${err.message}`));
    document.body.dataset.state = 'error';
  } finally {
    state.busy = false;
  }
}

export async function render() {
  document.head.append(el('link', {rel: 'stylesheet', href: './style.css'}));
  const root = el('main', {});
  document.body.append(root);
  const host = connectHost();
  state.filter = new URLSearchParams(window.location.search).get('runs'); // alone: plugin_entry.html?name=headwatch&runs=...
  if (host) {
    host.listen('experimental.RunsChanged', (runs) => { state.hostRuns = runs; refresh(root); });
    host.listen('experimental.DataReloaded', () => refresh(root));
    const runs = await within(host.send('experimental.GetRuns'), 1500);
    if (Array.isArray(runs)) state.hostRuns = runs;
  }
  document.body.dataset.host = host && state.hostRuns !== null ? 'tensorboard' : 'alone';
  document.body.dataset.filter = state.filter || '';
  if (!host || state.hostRuns === null) setInterval(() => refresh(root), 30000); // alone: reload every 30 s
  await refresh(root);
}
