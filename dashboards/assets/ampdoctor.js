/* ampdoctor dashboard: the page's linked zoom (a clientside callback) and data downloads (CSV, made in the
   browser from what a chart or a table shows: nothing is uploaded anywhere). Served from /assets/ (no inline
   script), so that a strict Content-Security-Policy holds. */
(function () {
  "use strict";

  function noUpdate() {
    return window.dash_clientside.no_update;
  }

  /* The x range a relayout event sets: [x0, x1], null for "the whole run" (autorange), undefined when the
     event is not about the x axis (a legend click, a resize). */
  function xRange(ev) {
    if (!ev) return undefined;
    if (ev["xaxis.autorange"] === true) return null;
    var a = ev["xaxis.range[0]"], b = ev["xaxis.range[1]"];
    if (a === undefined && Array.isArray(ev["xaxis.range"])) {
      a = ev["xaxis.range"][0];
      b = ev["xaxis.range"][1];
    }
    if (a === undefined || b === undefined) return undefined;
    a = Number(a);
    b = Number(b);
    if (!isFinite(a) || !isFinite(b)) return undefined;
    return [Math.round(Math.min(a, b)), Math.round(Math.max(a, b))];
  }

  window.dash_clientside = Object.assign({}, window.dash_clientside, {
    ampdoctor: {
      /* A view's settings into the address bar (pages/common.py address()), only while the navigation that opened
         the view is the current one: a server's answer that arrives after the user followed a link (a loaded
         machine) would otherwise put the previous page's settings on the next page's address. */
      address: function (want, pathname, search) {
        if (!want || want.page !== (pathname || "/") || want.opened !== (search || "")) return noUpdate();
        return want.search;
      },
      /* Any step chart of the page zoomed or reset: every chart of the page follows (the server redraws them for
         that range, at full resolution where it fits). Arguments: the relayoutData of each chart, then the
         current zoom. */
      zoom: function () {
        var args = Array.prototype.slice.call(arguments);
        var current = args.pop();
        var ctx = window.dash_clientside.callback_context;
        var trig = (ctx && ctx.triggered && ctx.triggered[0]) || null;
        if (!trig || !trig.prop_id) return noUpdate();
        if (/\.n_clicks$/.test(trig.prop_id)) return trig.value ? null : noUpdate(); /* "whole run" button */
        if (trig.prop_id.indexOf(".relayoutData") < 0) return noUpdate();
        var r = xRange(trig.value);
        if (r === undefined) return noUpdate();
        var next = r === null ? null : { x0: r[0], x1: r[1] };
        if (JSON.stringify(next) === JSON.stringify(current || null)) return noUpdate();
        return next;
      },
    },
  });

  /* -- tables ---------------------------------------------------------------------------------------------- */
  /* A data table (pages/common.py table()) comes as one element whose data-rows attribute holds its rows as
     JSON: {head, rows, bad (row indices), col (the column they mark), highlight (row indices)}. Drawn here as
     text (never markup: a cell is user data), once per value of the attribute; Dash's renderer would spend
     milliseconds on each cell as a component of its own. */
  var drawnRows = new WeakMap();

  function cellOf(tag, text, cls) {
    var c = document.createElement(tag);
    c.textContent = text;
    if (cls) c.className = cls;
    return c;
  }

  function drawTable(table) {
    var spec = table.getAttribute("data-rows");
    if (drawnRows.get(table) === spec) return;
    drawnRows.set(table, spec);
    var d;
    try {
      d = JSON.parse(spec);
    } catch (e) {
      return;
    }
    var head = document.createElement("tr");
    d.head.forEach(function (h) { head.appendChild(cellOf("th", h)); });
    var bad = new Set(d.bad), marked = new Set(d.highlight);
    var body = document.createElement("tbody");
    d.rows.forEach(function (r, i) {
      var tr = document.createElement("tr");
      if (marked.has(i)) tr.className = "highlight";
      r.forEach(function (v, j) { tr.appendChild(cellOf("td", v, bad.has(i) && j === d.col ? "bad" : "")); });
      body.appendChild(tr);
    });
    var thead = document.createElement("thead");
    thead.appendChild(head);
    table.replaceChildren(thead, body);
  }

  var drawPending = false;

  function drawTables() {
    drawPending = false;
    document.querySelectorAll("table[data-rows]").forEach(drawTable);
  }

  /* Dash mounts and updates the page's elements as callbacks answer: draw what changed, at most once a frame
     (and at once when the page is hidden, where no frame comes). */
  new MutationObserver(function () {
    if (drawPending) return;
    drawPending = true;
    if (document.hidden) setTimeout(drawTables, 0);
    else requestAnimationFrame(drawTables);
  }).observe(document.documentElement, { childList: true, subtree: true, attributes: true, attributeFilter: ["data-rows"] });

  window.ampdoctorTables = { draw: drawTables };

  /* -- CSV ------------------------------------------------------------------------------------------------- */
  var TYPES = {
    f8: Float64Array, f4: Float32Array, i4: Int32Array, u4: Uint32Array, i2: Int16Array, u2: Uint16Array,
    i1: Int8Array, u1: Uint8Array,
  };

  function decode(v) {
    if (!v || typeof v !== "object" || !v.bdata) return v;
    var bin = atob(v.bdata), bytes = new Uint8Array(bin.length);
    for (var i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    var T = TYPES[v.dtype];
    var flat;
    if (T) flat = Array.from(new T(bytes.buffer));
    else if (v.dtype === "i8" && typeof BigInt64Array !== "undefined")
      flat = Array.from(new BigInt64Array(bytes.buffer), Number);
    else return [];
    if (!v.shape) return flat;
    var dims = String(v.shape).split(",").map(Number), rows = [];
    for (var r = 0; r < dims[0]; r++) rows.push(flat.slice(r * dims[1], (r + 1) * dims[1]));
    return rows;
  }

  function list(v) {
    v = decode(v);
    if (v === undefined || v === null) return [];
    return Array.from(v);
  }

  function cell(v) {
    if (v === null || v === undefined) return "";
    var s = typeof v === "number" ? (isFinite(v) ? String(v) : "") : String(v);
    var t = document.createElement("textarea");
    t.innerHTML = s; /* plotly text holds entities (&lt;): the file gets the characters */
    s = t.value;
    return /[",\n]/.test(s) ? '"' + s.replace(/"/g, '""') + '"' : s;
  }

  function figureCsv(gd) {
    var lines = ["trace,x,y,z"];
    (gd.data || []).forEach(function (t) {
      var name = t.name || t.type || "";
      var meta = t.meta || {};
      if (meta.band) {
        (meta.spans || []).forEach(function (s) {
          lines.push([cell(meta.band + " (first step, last step)"), s[0], s[1], ""].join(","));
        });
        return;
      }
      if (t.type === "heatmap") {
        var x = list(t.x), y = list(t.y), z = list(t.z);
        for (var i = 0; i < y.length; i++)
          for (var j = 0; j < x.length; j++) lines.push([cell(name), cell(x[j]), cell(y[i]), cell((z[i] || [])[j])].join(","));
        return;
      }
      var xs = list(t.x), ys = list(t.y);
      for (var k = 0; k < Math.max(xs.length, ys.length); k++) lines.push([cell(name), cell(xs[k]), cell(ys[k]), ""].join(","));
    });
    return lines.join("\n") + "\n";
  }

  function tableCsv(table) {
    if (!table) return "";
    return Array.from(table.querySelectorAll("tr")).map(function (tr) {
      return Array.from(tr.querySelectorAll("th,td")).map(function (c) { return cell(c.textContent); }).join(",");
    }).join("\n") + "\n";
  }

  function download(text, name) {
    var url = URL.createObjectURL(new Blob([text], { type: "text/csv" }));
    var a = document.createElement("a");
    a.href = url;
    a.download = name;
    document.body.appendChild(a);
    a.click();
    a.remove();
    setTimeout(function () { URL.revokeObjectURL(url); }, 1000);
  }

  window.ampdoctorCsv = { figure: figureCsv, table: tableCsv };

  document.addEventListener("click", function (e) {
    var btn = e.target.closest && e.target.closest(".csv-download");
    if (!btn) return;
    var gid = btn.getAttribute("data-graph"), tid = btn.getAttribute("data-table");
    if (gid) {
      var host = document.getElementById(gid);
      var gd = host && (host.classList.contains("js-plotly-plot") ? host : host.querySelector(".js-plotly-plot"));
      if (gd) download(figureCsv(gd), "ampdoctor-" + gid + ".csv");
    } else {
      var table = tid ? document.getElementById(tid) : btn.parentElement.querySelector("table");
      download(tableCsv(table), "ampdoctor-" + (tid || "table") + ".csv");
    }
  });
})();
