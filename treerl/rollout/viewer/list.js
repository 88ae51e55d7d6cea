// treerl view, part 2 of 4: the list of groups. It filters and sorts over the index's columns and
// renders only the rows in view (virtual scrolling), so 10,000 groups cost what 40 do.
"use strict";
(function (TV) {
  const C = TV.index.columns;
  const ROW_H = 26;

  const COLUMNS = [
    { key: "step", label: "step", width: "3.5em", show: TV.index.hasSteps,
      cell: function (g) { return C.step[g] === null ? "" : String(C.step[g]); } },
    { key: "task", label: "task", width: "minmax(6em, 2fr)",
      cell: function (g) { return C.task[g] + (C.answer[g] !== null ? "  \u2192 " + C.answer[g] : ""); } },
    { key: "episodes", label: "eps", width: "3em", cell: function (g) { return String(C.episodes[g]); } },
    { key: "reward_mean", label: "reward \u00b1 std", width: "7.5em",
      cell: function (g) { return TV.fmt(C.reward_mean[g]) + " \u00b1 " + TV.fmt(C.reward_std[g]); } },
    { key: "success", label: "success", width: "4.5em", cell: function (g) { return Math.round(100 * C.success[g]) + "%"; } },
    { key: "packing", label: "packing", width: "4.5em", cell: function (g) { return TV.fmt(C.packing[g]); } },
    { key: "sampled_tokens", label: "length", width: "4em", cell: function (g) { return String(Math.round(C.sampled_tokens[g])); } },
    { key: "tool_errors", label: "tool err", width: "4.5em", cell: function (g) { return C.tool_errors[g] + "/" + C.tool_calls[g]; } },
  ].filter(function (c) { return c.show !== false; });
  const TEMPLATE = COLUMNS.map(function (c) { return c.width; }).join(" ");

  // Filter words: "key<op>value" compares a column, anything else matches task, env, answer or source.
  const ALIASES = { reward: "reward_mean", std: "reward_std", length: "sampled_tokens", tokens: "sampled_tokens",
                    errors: "tool_errors", calls: "tool_calls", eps: "episodes" };
  function parseFilter(text) {
    const tests = [];
    text.trim().split(/\s+/).filter(Boolean).forEach(function (word) {
      const m = /^(\w+)(<=|>=|!=|=|<|>)(.+)$/.exec(word);
      const key = m ? (ALIASES[m[1]] || m[1]) : null;
      if (m && key in C) {
        const num = Number(m[3]);
        const op = m[2];
        tests.push(function (g) {
          const v = C[key][g];
          const x = typeof v === "number" && !Number.isNaN(num) ? num : m[3];
          const val = typeof x === "number" ? v : String(v);
          switch (op) {
            case "<": return val < x;
            case ">": return val > x;
            case "<=": return val <= x;
            case ">=": return val >= x;
            case "!=": return val != x; // eslint-disable-line eqeqeq
            default: return typeof x === "number" ? val === x : String(val).toLowerCase().indexOf(String(x).toLowerCase()) >= 0;
          }
        });
      } else {
        const needle = word.toLowerCase();
        tests.push(function (g) {
          return C.task[g].toLowerCase().indexOf(needle) >= 0 || C.env[g].toLowerCase().indexOf(needle) >= 0 ||
                 (C.answer[g] !== null && String(C.answer[g]).toLowerCase().indexOf(needle) >= 0) ||
                 C.source[g].toLowerCase().indexOf(needle) >= 0;
        });
      }
    });
    return function (g) { return tests.every(function (t) { return t(g); }); };
  }

  const state = { rows: [], sortKey: null, sortDir: 1, selected: null, filter: "" };
  TV.list = state;
  const body = document.getElementById("list-body");
  const spacer = document.getElementById("list-spacer");
  const head = document.getElementById("list-head");
  const count = document.getElementById("list-count");

  function update() {
    const keep = parseFilter(state.filter);
    const rows = [];
    for (let g = 0; g < TV.numGroups; g++) if (keep(g)) rows.push(g);
    if (state.sortKey !== null) {
      const col = C[state.sortKey];
      const dir = state.sortDir;
      rows.sort(function (a, b) {
        const x = col[a], y = col[b];
        if (x === y) return a - b;
        if (x === null) return 1;
        if (y === null) return -1;
        return (x < y ? -1 : 1) * dir;
      });
    }
    state.rows = rows;
    count.textContent = rows.length === TV.numGroups ? TV.numGroups + " groups" : rows.length + " of " + TV.numGroups + " groups";
    spacer.style.height = rows.length * ROW_H + "px";
    render();
  }

  let rendered = [];
  function render() {
    rendered.forEach(function (el) { el.remove(); });
    rendered = [];
    const first = Math.max(0, Math.floor(body.scrollTop / ROW_H) - 5);
    const last = Math.min(state.rows.length, first + Math.ceil((body.clientHeight || 600) / ROW_H) + 10);
    const frag = document.createDocumentFragment();
    for (let i = first; i < last; i++) {
      const g = state.rows[i];
      const row = document.createElement("div");
      const solved = C.success[g] >= 1 ? " solved" : C.success[g] > 0 ? " partial" : "";
      row.className = "row" + (g === state.selected ? " selected" : "") + solved;
      row.style.top = i * ROW_H + "px";
      row.style.gridTemplateColumns = TEMPLATE;
      row.dataset.group = g;
      row.setAttribute("role", "row");
      COLUMNS.forEach(function (c) {
        const cell = document.createElement("span");
        cell.className = "cell cell-" + c.key;
        cell.textContent = c.cell(g);
        row.appendChild(cell);
      });
      frag.appendChild(row);
      rendered.push(row);
    }
    body.appendChild(frag);
  }

  function renderHead() {
    head.innerHTML = "";
    head.style.gridTemplateColumns = TEMPLATE;
    COLUMNS.forEach(function (c) {
      const b = document.createElement("button");
      b.type = "button";
      b.className = "sort";
      b.dataset.key = c.key;
      b.textContent = c.label + (state.sortKey === c.key ? (state.sortDir > 0 ? " \u25b2" : " \u25bc") : "");
      head.appendChild(b);
    });
  }

  head.addEventListener("click", function (ev) {
    const b = ev.target.closest("button.sort");
    if (!b) return;
    if (state.sortKey === b.dataset.key) state.sortDir = -state.sortDir;
    else { state.sortKey = b.dataset.key; state.sortDir = b.dataset.key === "task" || b.dataset.key === "step" ? 1 : -1; }
    renderHead();
    update();
  });
  body.addEventListener("scroll", function () { window.requestAnimationFrame(render); });
  body.addEventListener("click", function (ev) {
    const row = ev.target.closest(".row");
    if (row) TV.select(Number(row.dataset.group));
  });
  body.addEventListener("keydown", function (ev) {
    if (ev.key !== "ArrowDown" && ev.key !== "ArrowUp") return;
    const at = state.rows.indexOf(state.selected);
    const next = state.rows[Math.min(state.rows.length - 1, Math.max(0, at + (ev.key === "ArrowDown" ? 1 : -1)))];
    if (next !== undefined) { TV.select(next); ev.preventDefault(); }
  });
  let timer = null;
  document.getElementById("filter").addEventListener("input", function (ev) {
    window.clearTimeout(timer);
    timer = window.setTimeout(function () { state.filter = ev.target.value; body.scrollTop = 0; update(); }, 120);
  });

  TV.markSelected = function (g) {
    state.selected = g;
    const i = state.rows.indexOf(g);
    if (i >= 0 && (i * ROW_H < body.scrollTop || (i + 1) * ROW_H > body.scrollTop + body.clientHeight)) {
      body.scrollTop = Math.max(0, i * ROW_H - body.clientHeight / 2);
    }
    render();
  };
  TV.initList = function () { renderHead(); update(); };
})(window.TV);
