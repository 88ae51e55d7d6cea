// treerl view, part 1 of 4: the data. The index is parsed at load; a group's payload only when it
// is opened. Token ids and log-probs arrive as base64 little-endian typed arrays.
"use strict";
window.TV = window.TV || {};
(function (TV) {
  const INDEX = JSON.parse(document.getElementById("treerl-index").textContent);
  TV.index = INDEX;
  TV.numGroups = INDEX.columns.task.length;
  TV.KINDS = ["prompt", "sampled", "env"];

  let lines = null; // the payload lines, split on first use
  function payloadLine(i) {
    if (lines === null) lines = document.getElementById("treerl-groups").textContent.split("\n");
    return lines[i];
  }

  function bytesOf(b64) {
    const bin = atob(b64);
    const out = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out.buffer;
  }
  function ids(b64) {
    return INDEX.idBytes === 2 ? new Uint16Array(bytesOf(b64)) : new Uint32Array(bytesOf(b64));
  }
  function floats(b64) {
    return b64 === null ? null : new Float32Array(bytesOf(b64));
  }

  // Each id's bytes: a string when they are valid UTF-8 alone, else a list of byte values.
  const encoder = new TextEncoder();
  const pieceBytes = new Map();
  function bytesOfToken(id) {
    let b = pieceBytes.get(id);
    if (b === undefined) {
      const p = INDEX.vocab[id];
      b = p === undefined ? encoder.encode("\u27e8" + id + "\u27e9") : typeof p === "string" ? encoder.encode(p) : Uint8Array.from(p);
      pieceBytes.set(id, b);
    }
    return b;
  }

  // The text of each token of a segment. A character whose bytes span several tokens is given to
  // the token that completes it (UTF-8 decoded in stream mode).
  function tokenTexts(tokenIds) {
    const out = new Array(tokenIds.length);
    let allText = true;
    for (let i = 0; i < tokenIds.length; i++) {
      const p = INDEX.vocab[tokenIds[i]];
      if (typeof p !== "string") { allText = false; break; }
      out[i] = p;
    }
    if (allText) return out;
    const decoder = new TextDecoder("utf-8");
    for (let i = 0; i < tokenIds.length; i++) out[i] = decoder.decode(bytesOfToken(tokenIds[i]), { stream: true });
    const tail = decoder.decode();
    if (tail && tokenIds.length) out[tokenIds.length - 1] += tail;
    return out;
  }
  TV.tokenTexts = tokenTexts;

  // -- one group ---------------------------------------------------------------------------------
  const cache = new Map();
  TV.group = function (g) {
    if (cache.has(g)) return cache.get(g);
    const raw = JSON.parse(payloadLine(g));
    const segs = raw.s.map(function (s, i) {
      return { index: i, kind: TV.KINDS[s[0]], parent: s[1], ids: ids(s[2]), lp: floats(s[3]), tr: floats(s[4]),
               version: s[5], finish: s[6], texts: null };
    });
    const episodes = raw.e.map(function (e, i) {
      return { index: i, leaf: e.l, extra: e.x || [], reward: e.r, rewards: e.rs || [], adv: e.a,
               termination: e.t, turns: e.n,
               calls: (e.c || []).map(function (c) { return { segment: c[0], name: c[1], args: c[2], error: c[3], message: c[4] }; }) };
    });
    const group = { index: g, segs: segs, episodes: episodes, info: raw.i || {} };
    group.tree = buildTree(group);
    if (cache.size > 16) cache.delete(cache.keys().next().value);
    cache.set(g, group);
    return group;
  };

  TV.segTexts = function (seg) {
    if (seg.texts === null) seg.texts = tokenTexts(seg.ids);
    return seg.texts;
  };

  // -- the display tree ----------------------------------------------------------------------------
  // Stored segments already share the prompt (and forked prefixes). Sibling samples often agree on
  // their first tokens, so siblings of one kind and policy version are merged token by token: a
  // display node is a span [start, end) of a representative segment, shared by its member segments,
  // and a branch starts where they first differ. A node lists the segments that end at it; their
  // stored children, episodes and tool calls hang there.
  function buildTree(group) {
    const kids = group.segs.map(function () { return []; });
    const roots = [];
    group.segs.forEach(function (s) { if (s.parent === null) roots.push(s.index); else kids[s.parent].push(s.index); });
    const leafOf = new Map();
    const extraOf = new Map();
    group.episodes.forEach(function (e) {
      (leafOf.get(e.leaf) || leafOf.set(e.leaf, []).get(e.leaf)).push(e);
      e.extra.forEach(function (x) { (extraOf.get(x) || extraOf.set(x, []).get(x)).push(e); });
    });
    // Episodes forked after a turn all carry that turn's calls: take a segment's calls from the
    // first episode that lists them. (Files without a call's segment put calls at the leaf.)
    const callsOf = new Map();
    group.episodes.forEach(function (e) {
      const mine = new Map();
      e.calls.forEach(function (c) {
        const at = c.segment === null || c.segment === undefined ? e.leaf : c.segment;
        (mine.get(at) || mine.set(at, []).get(at)).push(c);
      });
      mine.forEach(function (calls, at) { if (!callsOf.has(at)) callsOf.set(at, calls); });
    });
    let nextId = 0;
    const nodes = [];

    function newNode(seg, start, end, members) {
      const node = { id: nextId++, seg: seg, start: start, end: end, members: members, children: [],
                     ended: [], episodes: [], extraEpisodes: [], calls: [] };
      nodes.push(node);
      return node;
    }
    function siblings(segIds) {
      const parts = new Map();
      segIds.forEach(function (s) {
        const seg = group.segs[s];
        const key = seg.ids.length === 0 ? "empty" + s : seg.kind + "/" + seg.version;
        (parts.get(key) || parts.set(key, []).get(key)).push([s, 0]);
      });
      let out = [];
      parts.forEach(function (items) { out = out.concat(trie(items)); });
      return out;
    }
    function trie(items) {
      const buckets = new Map();
      items.forEach(function (it) {
        const seg = group.segs[it[0]];
        const key = seg.ids.length === 0 ? "empty" : seg.ids[it[1]];
        (buckets.get(key) || buckets.set(key, []).get(key)).push(it);
      });
      const out = [];
      buckets.forEach(function (bucket) {
        const first = group.segs[bucket[0][0]];
        let c = 0;
        if (first.ids.length > 0) {
          for (;;) {
            const pos0 = bucket[0][1] + c;
            if (pos0 >= first.ids.length) break;
            const tok = first.ids[pos0];
            const same = bucket.every(function (it) {
              const s = group.segs[it[0]];
              return it[1] + c < s.ids.length && s.ids[it[1] + c] === tok;
            });
            if (!same) break;
            c++;
          }
        }
        const node = newNode(bucket[0][0], bucket[0][1], bucket[0][1] + c, bucket.map(function (it) { return it[0]; }));
        const rest = [];
        bucket.forEach(function (it) {
          if (it[1] + c < group.segs[it[0]].ids.length) rest.push([it[0], it[1] + c]);
          else node.ended.push(it[0]);
        });
        node.children = trie(rest);
        let below = [];
        node.ended.forEach(function (s) {
          below = below.concat(kids[s]);
          node.episodes = node.episodes.concat(leafOf.get(s) || []);
          node.extraEpisodes = node.extraEpisodes.concat(extraOf.get(s) || []);
          node.calls = node.calls.concat(callsOf.get(s) || []);
        });
        node.children = node.children.concat(siblings(below));
        out.push(node);
      });
      return out;
    }
    const top = siblings(roots);
    // Bottom-up: leaves (episodes ending) and their rewards under each node.
    function stats(node) {
      let n = node.episodes.length;
      let sum = node.episodes.reduce(function (a, e) { return a + e.reward; }, 0);
      node.children.forEach(function (ch) { stats(ch); n += ch.numLeaves; sum += ch.rewardSum; });
      node.numLeaves = n;
      node.rewardSum = sum;
    }
    top.forEach(stats);
    return { roots: top, nodes: nodes };
  }

  // -- colours -------------------------------------------------------------------------------------
  // Sampler log-prob: probability 1 is white, 0 is red. Ratio exp(trainer - sampler): blue below 1,
  // red above, full colour at a factor of e^0.5 (about 1.65) either way.
  TV.logprobColour = function (lp) {
    const p = Math.exp(lp);
    const a = Math.min(1, Math.max(0, 1 - p));
    return "rgba(220,40,40," + (0.08 + 0.72 * a).toFixed(3) + ")";
  };
  TV.ratioColour = function (logRatio) {
    const a = Math.min(1, Math.abs(logRatio) / 0.5);
    if (a < 0.01) return "transparent";
    return (logRatio > 0 ? "rgba(220,40,40," : "rgba(40,90,220,") + (0.1 + 0.7 * a).toFixed(3) + ")";
  };
  TV.fmt = function (x, digits) {
    if (x === null || x === undefined || Number.isNaN(x)) return "-";
    return Number(x).toFixed(digits === undefined ? 2 : digits);
  };
})(window.TV);
