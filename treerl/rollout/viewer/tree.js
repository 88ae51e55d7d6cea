// treerl view, part 3 of 4: one group as a tree. A chain of single children reads top to bottom;
// where episodes diverge, each branch is a collapsed line that renders its subtree when opened.
"use strict";
(function (TV) {
  const TEXT_LIMIT = 1000;   // a text longer than this many characters is collapsed ...
  const TEXT_HEAD = 240;     // ... to its first ...
  const TEXT_TAIL = 360;     // ... and last characters
  const KIND_LABEL = { prompt: "prompt", sampled: "model", env: "environment" };
  // Tool-call markup of the common formats: Hermes/Qwen, Qwen3-Coder, Mistral, Llama 3.
  const CALL_MARKUP = new RegExp(["<tool_call>[\\s\\S]*?(</tool_call>|$)", "<function=[\\s\\S]*?(</function>|$)",
                                  "\\[TOOL_CALLS\\][\\s\\S]*", "<\\|python_tag\\|>[\\s\\S]*"].join("|"), "g");

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  // A rendered group: which nodes are on the page, and which texts the user expanded.
  function View(group) {
    this.group = group;
    this.shown = [];            // [node, text element]
    this.fullText = new Set();  // node ids whose long text is shown whole
  }

  View.prototype.worstOutcome = function (node) {
    let worst = null;
    node.calls.forEach(function (c) { if (c.error) worst = worst || c.error; else if (worst === null) worst = "ok"; });
    return worst;
  };

  View.prototype.fillText = function (node, box) {
    const seg = this.group.segs[node.seg];
    const texts = TV.segTexts(seg).slice(node.start, node.end);
    box.textContent = "";
    if (node.end === node.start) { box.appendChild(el("span", "empty", "(no tokens)")); return; }
    const total = texts.reduce(function (a, t) { return a + t.length; }, 0);
    // A long text shows its head and its tail (a prompt's question is at its end) until expanded.
    let head = texts.length, tail = texts.length;
    if (total > TEXT_LIMIT && !this.fullText.has(node.id)) {
      let chars = 0;
      for (head = 0; head < texts.length && chars < TEXT_HEAD; head++) chars += texts[head].length;
      for (chars = 0, tail = texts.length; tail > head && chars < TEXT_TAIL; tail--) chars += texts[tail - 1].length;
    }
    this.tokens(node, box, texts, 0, head);
    if (head < tail) {
      const more = el("button", "more", "\u2026 " + (tail - head) + " more tokens: show all (" + total + " characters)");
      more.type = "button";
      const view = this;
      more.addEventListener("click", function () { view.fullText.add(node.id); view.fillText(node, box); });
      box.appendChild(more);
      this.tokens(node, box, texts, tail, texts.length);
    }
  };

  // Tokens [from, to) of a node: plain text, or one coloured span per token.
  View.prototype.tokens = function (node, box, texts, from, to) {
    const seg = this.group.segs[node.seg];
    const mode = TV.colour;
    const colours = seg.kind === "sampled" && seg.lp !== null && (mode === "logprob" || (mode === "ratio" && seg.tr !== null));
    if (!colours) { this.plainText(node, box, texts.slice(from, to).join("")); return; }
    const frag = document.createDocumentFragment();
    for (let i = from; i < to; i++) {
      const at = node.start + i;
      const span = el("span", "tok", texts[i]);
      const lp = seg.lp[at];
      let tip = "id " + seg.ids[at] + "  logp " + TV.fmt(lp, 4) + "  (p " + TV.fmt(Math.exp(lp), 4) + ")";
      if (seg.tr !== null) tip += "  trainer logp " + TV.fmt(seg.tr[at], 4) + "  ratio " + TV.fmt(Math.exp(seg.tr[at] - lp), 4);
      span.title = tip;
      span.style.background = mode === "logprob" ? TV.logprobColour(lp) : TV.ratioColour(seg.tr[at] - lp);
      frag.appendChild(span);
    }
    box.appendChild(frag);
  };

  // Tool-call markup in a model turn is highlighted with the outcome of that turn's calls.
  View.prototype.plainText = function (node, box, text) {
    const outcome = this.group.segs[node.seg].kind === "sampled" ? this.worstOutcome(node) : null;
    if (outcome === null) { box.appendChild(document.createTextNode(text)); return; }
    let last = 0;
    for (const m of text.matchAll(CALL_MARKUP)) {
      if (!m[0]) continue;
      if (m.index > last) box.appendChild(document.createTextNode(text.slice(last, m.index)));
      const span = el("span", "toolcall outcome-" + outcome, m[0]);
      span.title = "tool call: " + outcome;
      box.appendChild(span);
      last = m.index + m[0].length;
    }
    if (last < text.length) box.appendChild(document.createTextNode(text.slice(last)));
  };

  View.prototype.nodeEl = function (node) {
    const seg = this.group.segs[node.seg];
    const box = el("div", "node kind-" + seg.kind);
    box.dataset.node = node.id;
    const head = el("div", "node-head");
    head.appendChild(el("span", "kind", KIND_LABEL[seg.kind]));
    if (seg.kind === "sampled" && seg.version !== null) head.appendChild(el("span", "version", "policy v" + seg.version));
    head.appendChild(el("span", "ntok", (node.end - node.start) + " tokens"));
    if (node.members.length > 1) head.appendChild(el("span", "shared", "shared by " + node.members.length + " samples"));
    if (seg.finish === "length" && node.ended.length) head.appendChild(el("span", "cut", "cut at max_new_tokens"));
    box.appendChild(head);
    const text = el("div", "text");
    this.fillText(node, text);
    this.shown.push([node, text]);
    box.appendChild(text);
    if (node.calls.length) box.appendChild(this.callsEl(node.calls));
    const group = this.group;
    node.episodes.forEach(function (e) { box.appendChild(leafEl(e, group)); });
    node.extraEpisodes.forEach(function (e) {
      box.appendChild(el("div", "leaf extra", "earlier context of episode " + e.index +
                         " (the chat template re-rendered it; trained with that episode's reward)"));
    });
    return box;
  };

  View.prototype.callsEl = function (calls) {
    const box = el("div", "calls");
    const seen = new Map();
    calls.forEach(function (c) {
      const key = JSON.stringify([c.name, c.args, c.error, c.message]);
      if (seen.has(key)) { seen.get(key).n++; return; }
      seen.set(key, { call: c, n: 1 });
    });
    seen.forEach(function (item) {
      const c = item.call;
      const outcome = c.error || "ok";
      const line = el("div", "call outcome-" + outcome);
      line.appendChild(el("span", "call-badge", outcome));
      const what = (c.name || "(no tool)") + (c.args !== null && c.args !== undefined ? " " + JSON.stringify(c.args) : "");
      line.appendChild(el("code", "call-what", what));
      if (c.message) line.appendChild(el("span", "call-message", "\u2192 " + c.message));
      if (item.n > 1) line.appendChild(el("span", "call-count", "\u00d7" + item.n));
      box.appendChild(line);
    });
    return box;
  };

  function leafEl(e, group) {
    const ok = e.rewards.length ? e.rewards[e.rewards.length - 1] >= 1 : e.reward >= 1;
    const box = el("div", "leaf " + (ok ? "success" : "fail"));
    box.dataset.episode = e.index;
    box.appendChild(el("span", "leaf-title", "episode " + e.index));
    box.appendChild(el("span", "reward", "reward " + TV.fmt(e.reward)));
    if (e.adv !== null && e.adv !== undefined) {
      box.appendChild(el("span", "adv", "advantage " + (e.adv >= 0 ? "+" : "") + TV.fmt(e.adv, 3)));
    }
    if (e.termination) box.appendChild(el("span", "term", e.termination));
    if (e.turns !== null && e.turns !== undefined) box.appendChild(el("span", "turns", e.turns + " turns"));
    if (e.rewards.length > 1) {
      box.appendChild(el("span", "per-turn", "per turn [" + e.rewards.map(function (r) { return TV.fmt(r); }).join(", ") + "]"));
    }
    return box;
  }

  // A chain reads top to bottom; at a fork each child is a collapsed branch.
  View.prototype.renderChain = function (node, parent) {
    let cur = node;
    for (;;) {
      parent.appendChild(this.nodeEl(cur));
      if (cur.children.length === 1) { cur = cur.children[0]; continue; }
      if (cur.children.length > 1) {
        const forks = el("div", "branches");
        const view = this;
        cur.children.forEach(function (ch, k) { forks.appendChild(view.branchEl(ch, k, cur.children.length)); });
        parent.appendChild(forks);
      }
      return;
    }
  };

  View.prototype.branchEl = function (node, k, n) {
    const seg = this.group.segs[node.seg];
    const box = el("div", "branch");
    box.dataset.node = node.id;
    const head = el("button", "branch-head");
    head.type = "button";
    head.setAttribute("aria-expanded", "false");
    const preview = TV.segTexts(seg).slice(node.start, Math.min(node.end, node.start + 12)).join("").replace(/\s+/g, " ");
    head.appendChild(el("span", "caret", "\u25b8"));
    head.appendChild(el("span", "branch-name", "branch " + (k + 1) + "/" + n));
    head.appendChild(el("span", "branch-leaves", node.numLeaves + (node.numLeaves === 1 ? " episode" : " episodes")));
    if (node.numLeaves) head.appendChild(el("span", "branch-reward", "mean reward " + TV.fmt(node.rewardSum / node.numLeaves)));
    head.appendChild(el("span", "branch-kind kind-" + seg.kind, KIND_LABEL[seg.kind]));
    head.appendChild(el("span", "branch-preview", preview));
    const body = el("div", "branch-body");
    body.hidden = true;
    const view = this;
    head.addEventListener("click", function () { view.toggle(box, body.hidden); });
    box.appendChild(head);
    box.appendChild(body);
    return box;
  };

  View.prototype.toggle = function (branch, open) {
    const body = branch.querySelector(":scope > .branch-body");
    const head = branch.querySelector(":scope > .branch-head");
    if (open && !body.firstChild) {
      const node = this.group.tree.nodes[Number(branch.dataset.node)];
      this.renderChain(node, body);
    }
    body.hidden = !open;
    head.setAttribute("aria-expanded", String(open));
    head.querySelector(".caret").textContent = open ? "\u25be" : "\u25b8";
  };

  View.prototype.setAll = function (root, open) {
    // Opening renders new branches inside the ones opened: repeat until none is left closed.
    for (let pass = 0; pass < 1000; pass++) {
      const todo = Array.prototype.filter.call(root.querySelectorAll(".branch"), function (b) {
        return b.querySelector(":scope > .branch-body").hidden === open;
      });
      if (!todo.length) return;
      const view = this;
      todo.forEach(function (b) { view.toggle(b, open); });
      if (!open) return;
    }
  };

  View.prototype.recolour = function () {
    const view = this;
    this.shown.forEach(function (pair) { view.fillText(pair[0], pair[1]); });
  };

  TV.renderGroup = function (g, into) {
    const group = TV.group(g);
    const view = new View(group);
    const C = TV.index.columns;
    into.textContent = "";
    const head = el("div", "group-head");
    head.appendChild(el("h2", "group-title", C.task[g] + (C.step[g] !== null ? "  (step " + C.step[g] + ")" : "")));
    const facts = [
      ["environment", C.env[g]], ["answer", C.answer[g] === null ? "-" : C.answer[g]],
      ["episodes", String(group.episodes.length)],
      ["leaves", String(group.tree.roots.reduce(function (a, n) { return a + n.numLeaves; }, 0))],
      ["reward", TV.fmt(C.reward_mean[g]) + " \u00b1 " + TV.fmt(C.reward_std[g])], ["success", Math.round(100 * C.success[g]) + "%"],
      ["packing ratio", TV.fmt(C.packing[g])], ["tree nodes", String(group.tree.nodes.length)],
    ];
    const dl = el("dl", "facts");
    facts.forEach(function (f) {
      const d = el("div", "fact");
      d.appendChild(el("dt", null, f[0]));
      d.appendChild(el("dd", "fact-" + f[0].replace(/ /g, "-"), f[1]));
      dl.appendChild(d);
    });
    head.appendChild(dl);
    into.appendChild(head);
    const tree = el("div", "tree-body");
    group.tree.roots.forEach(function (root) { view.renderChain(root, tree); });
    into.appendChild(tree);
    return view;
  };
})(window.TV);
