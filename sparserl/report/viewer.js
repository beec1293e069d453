// The sample viewer of `python -m sparserl.report`: reads the JSON block #report-data, draws a step selector and,
// per logged sequence, its response tokens coloured by log xi = logp_old - logp_sparse (red: the dense policy gives
// the token more probability than the compressed-cache sampler did; blue: less), with KV compression points,
// masked and veto tokens, and rejected sequences marked. Plain DOM, no libraries, no network.
"use strict";

(function () {
  const data = JSON.parse(document.getElementById("report-data").textContent);
  const state = { index: data.steps.length - 1, onlyRejected: false, scale: 1.0 };
  const el = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  };
  const fmt = (x, d = 3) => (x === null || x === undefined ? "n/a" : Number(x).toFixed(d));

  // Diverging white -> red (positive) / white -> blue (negative), saturated at |log xi| = scale.
  function colour(v, scale) {
    if (v === null || v === undefined) return "rgb(230, 230, 230)";
    const t = Math.max(-1, Math.min(1, v / scale));
    const [r, g, b] = t >= 0 ? [178, 24, 43] : [33, 102, 172];
    const a = Math.abs(t);
    const mix = (c) => Math.round(255 + (c - 255) * a);
    return `rgb(${mix(r)}, ${mix(g)}, ${mix(b)})`;
  }

  function configTable() {
    const box = document.getElementById("run-config");
    const keys = Object.keys(data.config);
    if (!keys.length) return;
    const table = el("table", "config");
    for (const k of keys) {
      const tr = el("tr");
      tr.append(el("th", "", k), el("td", "", data.config[k]));
      table.append(tr);
    }
    box.append(table);
  }

  function controls() {
    const box = document.getElementById("controls");
    if (!data.steps.length) {
      box.append(el("p", "empty", "No logged samples in this run (trainer.log_samples=0, or a run from before they existed)."));
      return;
    }
    const prev = el("button", "", "\u25C0 prev");
    const next = el("button", "", "next \u25B6");
    const select = el("select");
    select.id = "step-select";
    data.steps.forEach((s, i) => {
      const o = el("option", "", `step ${s.step} (${s.records.length} samples)`);
      o.value = String(i);
      select.append(o);
    });
    select.value = String(state.index);
    select.onchange = () => { state.index = Number(select.value); render(); };
    prev.onclick = () => { if (state.index > 0) { state.index -= 1; select.value = String(state.index); render(); } };
    next.onclick = () => { if (state.index < data.steps.length - 1) { state.index += 1; select.value = String(state.index); render(); } };
    const only = el("input");
    only.type = "checkbox";
    only.id = "only-rejected";
    only.onchange = () => { state.onlyRejected = only.checked; render(); };
    const onlyLabel = el("label", "", " only rejected");
    onlyLabel.prepend(only);
    const scale = el("select");
    for (const s of [0.1, 0.3, 1, 3]) {
      const o = el("option", "", `colour scale \u00B1${s}`);
      o.value = String(s);
      scale.append(o);
    }
    scale.value = String(state.scale);
    scale.onchange = () => { state.scale = Number(scale.value); legend(); render(); };
    box.append(prev, select, next, onlyLabel, scale);
    if (data.left_out.length) {
      box.append(el("span", "note", ` ${data.left_out.length} logged steps left out of this page (--max-steps)`));
    }
  }

  function legend() {
    const box = document.getElementById("legend");
    box.textContent = "";
    const bar = el("span", "bar");
    bar.style.background = `linear-gradient(to right, ${colour(-state.scale, state.scale)}, white, ${colour(state.scale, state.scale)})`;
    box.append(el("span", "", `log xi \u2264 \u2212${state.scale} `), bar, el("span", "", ` \u2265 +${state.scale}`));
    const cut = el("span", "cut", "");
    const items = [
      [cut, "KV cache compressed: later tokens sampled from the compressed cache"],
      [el("span", "tok masked", "tok"), "masked (xi outside [token_low, token_high])"],
      [el("span", "tok veto", "tok"), "veto token (xi < veto: rejects the sequence)"],
      [el("span", "tok env", "tok"), "env token (not trained)"],
    ];
    for (const [sample, text] of items) {
      const item = el("span", "item");
      item.append(sample, el("span", "", " " + text));
      box.append(item);
    }
  }

  function tokenTitle(tok, i) {
    const xi = tok.log_xi[i] === null ? "n/a" : Math.exp(tok.log_xi[i]).toFixed(4);
    const flags = [];
    if (!tok.loss_mask[i]) flags.push("env token");
    if (tok.masked[i]) flags.push("masked");
    if (tok.veto[i]) flags.push("veto");
    return `#${i} ${JSON.stringify(tok.text[i])}\nlogp_sparse ${fmt(tok.logp_sparse[i], 4)}\nlogp_old ${fmt(tok.logp_old[i], 4)}\n` +
      `log xi ${fmt(tok.log_xi[i], 5)} (xi ${xi})\nweight ${fmt(tok.weight[i], 4)}` + (flags.length ? `\n${flags.join(", ")}` : "");
  }

  function card(rec) {
    const c = el("div", "sample" + (rec.rejected ? " rejected" : ""));
    const head = el("div", "head");
    const tok = rec.tokens;
    const absMax = Math.max(0, ...tok.log_xi.map((v, i) => (tok.loss_mask[i] && v !== null ? Math.abs(v) : 0)));
    head.append(el("b", "", `sample ${rec.index}`),
      el("span", "", ` group ${rec.group} \u00B7 reward ${fmt(rec.reward, 2)} \u00B7 advantage ${fmt(rec.advantage, 3)} \u00B7 ` +
        `${rec.num_tokens} tokens \u00B7 ${rec.turns} turn(s) \u00B7 ${rec.compressed_at.length} compressions \u00B7 ` +
        `KV kept ${rec.kv_retained_frac === null ? "n/a" : (100 * rec.kv_retained_frac).toFixed(0) + "%"} \u00B7 max |log xi| ${fmt(absMax, 3)}`));
    if (rec.rejected) {
      const why = rec.vetoed ? "veto" : "geometric-mean bound";
      head.append(el("span", "badge bad", rec.correction === "apply" ? `REJECTED (${why})` : `would be rejected (${why}, ${rec.correction} mode)`));
    }
    const masked = tok.masked.reduce((a, b) => a + b, 0);
    if (masked) head.append(el("span", "badge warn", `${masked} masked`));
    if (rec.status !== "ok") head.append(el("span", "badge", rec.status));
    c.append(head);
    const prompt = el("details", "prompt");
    prompt.append(el("summary", "", "prompt"), el("pre", "", (rec.prompt_chars_dropped ? "\u2026" : "") + rec.prompt));
    c.append(prompt);
    const body = el("div", "tokens");
    const cuts = new Map(rec.compressed_at.map((k, j) => [k, j + 1]));
    for (let i = 0; i < tok.text.length; i++) {
      if (cuts.has(i)) {
        const cut = el("span", "cut", "");
        cut.title = `KV cache compression ${cuts.get(i)} of ${rec.compressed_at.length}: token ${i} onward sampled from the compressed cache`;
        body.append(cut);
      }
      const s = el("span", "tok", tok.text[i]);
      if (!tok.loss_mask[i]) s.classList.add("env");
      else s.style.backgroundColor = colour(tok.log_xi[i], state.scale);
      if (tok.masked[i]) s.classList.add("masked");
      if (tok.veto[i]) s.classList.add("veto");
      s.title = tokenTitle(tok, i);
      body.append(s);
    }
    if (rec.tokens_dropped) body.append(el("span", "note", ` \u2026 ${rec.tokens_dropped} more tokens not logged`));
    c.append(body);
    c.append(el("div", "meta", `reward ${fmt(rec.reward, 3)}, score ${fmt(rec.score, 3)}, finish ${rec.finish_reason}, correction ${rec.correction}`));
    return c;
  }

  function render() {
    const box = document.getElementById("samples");
    box.textContent = "";
    if (!data.steps.length) return;
    const step = data.steps[state.index];
    const records = step.records.filter((r) => !state.onlyRejected || r.rejected);
    if (!records.length) box.append(el("p", "empty", "No sample matches at this step."));
    for (const rec of records) box.append(card(rec));
    // For readers and for the headless-browser test: how much was drawn.
    const coloured = [...box.querySelectorAll(".tok")].filter((s) => s.style.backgroundColor && s.style.backgroundColor !== "rgb(255, 255, 255)");
    document.body.dataset.step = String(step.step);
    document.body.dataset.samples = String(records.length);
    document.body.dataset.colouredTokens = String(coloured.length);
    document.body.dataset.cuts = String(box.querySelectorAll(".cut").length);
  }

  function curvesReady() {
    const img = document.getElementById("curves");
    const done = () => { document.body.dataset.curves = img.naturalWidth > 0 ? "loaded" : "broken"; };
    if (img.complete) done(); else { img.onload = done; img.onerror = done; }
  }

  configTable();
  controls();
  legend();
  render();
  curvesReady();
})();
