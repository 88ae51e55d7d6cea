// treerl view, part 4 of 4: the page. Title and totals, the colouring buttons and the legend, the
// selected group (also in the address's #group=N), and a ready mark for tests and benchmarks.
"use strict";
(function (TV) {
  const C = TV.index.columns;
  const tree = document.getElementById("tree");
  const legend = document.getElementById("legend");
  let view = null;
  TV.colour = "none";

  document.getElementById("title").textContent = TV.index.title;
  const episodes = C.episodes.reduce(function (a, b) { return a + b; }, 0);
  document.getElementById("totals").textContent = TV.numGroups + " groups, " + episodes + " episodes" +
    (TV.index.hasAdvantage ? ", with advantages" : "") + (TV.index.hasTrainer ? ", with trainer log-probs" : "");

  const ratioButton = document.querySelector('button.colour[data-colour="ratio"]');
  if (!TV.index.hasTrainer) {
    ratioButton.disabled = true;
    ratioButton.title = "these trajectories hold no trainer log-probs (treerl learn stores them in its samples)";
  }

  function showLegend() {
    legend.textContent = "";
    if (TV.colour === "logprob") {
      legend.appendChild(swatch(TV.logprobColour(0), "p = 1"));
      legend.appendChild(swatch(TV.logprobColour(Math.log(0.5)), "p = 0.5"));
      legend.appendChild(swatch(TV.logprobColour(-20), "p \u2248 0"));
    } else if (TV.colour === "ratio") {
      legend.appendChild(swatch(TV.ratioColour(-0.5), "ratio \u2264 0.61"));
      legend.appendChild(swatch(TV.ratioColour(0), "ratio 1"));
      legend.appendChild(swatch(TV.ratioColour(0.5), "ratio \u2265 1.65"));
      if (view !== null) legend.appendChild(document.createTextNode(ratioRange(view.group)));
    }
  }
  function swatch(colour, label) {
    const s = document.createElement("span");
    s.className = "swatch";
    s.style.background = colour;
    s.textContent = label;
    return s;
  }
  function ratioRange(group) {
    let lo = Infinity, hi = -Infinity;
    group.segs.forEach(function (s) {
      if (s.tr === null || s.lp === null) return;
      for (let i = 0; i < s.tr.length; i++) { const r = s.tr[i] - s.lp[i]; if (r < lo) lo = r; if (r > hi) hi = r; }
    });
    if (lo === Infinity) return "  (no trainer log-probs in this group)";
    return "  this group: " + TV.fmt(Math.exp(lo), 4) + " to " + TV.fmt(Math.exp(hi), 4);
  }

  document.getElementById("tree-tools").addEventListener("click", function (ev) {
    const b = ev.target.closest("button");
    if (!b || b.disabled) return;
    if (b.classList.contains("colour")) {
      TV.colour = b.dataset.colour;
      document.querySelectorAll("button.colour").forEach(function (x) { x.setAttribute("aria-pressed", String(x === b)); });
      if (view !== null) view.recolour();
      showLegend();
    } else if (view !== null && (b.id === "expand-all" || b.id === "collapse-all")) {
      view.setAll(tree, b.id === "expand-all");
    }
  });

  TV.select = function (g) {
    view = TV.renderGroup(g, tree);
    TV.markSelected(g);
    showLegend();
    if (window.location.hash !== "#group=" + g) window.history.replaceState(null, "", "#group=" + g);
  };

  // For tests and benchmarks: run one action, return its milliseconds, the layout it causes
  // included (reading offsetHeight forces the layout before the clock stops).
  function timed(action) {
    const t = performance.now();
    action();
    void document.body.offsetHeight;
    return performance.now() - t;
  }
  TV.timed = {
    open: function (g) { return timed(function () { TV.select(g); }); },
    colour: function (mode) { return timed(function () { document.querySelector('button.colour[data-colour="' + mode + '"]').click(); }); },
    sort: function (key) { return timed(function () { document.querySelector('#list-head button[data-key="' + key + '"]').click(); }); },
  };

  TV.initList();
  const wanted = /^#group=(\d+)$/.exec(window.location.hash);
  if (wanted && Number(wanted[1]) < TV.numGroups) TV.select(Number(wanted[1]));
  // Time from navigation start until the page can be used, for tests and benchmarks.
  TV.readyMs = performance.now();
  document.body.dataset.ready = "1";
})(window.TV);
