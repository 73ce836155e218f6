// Counters refresh without a reload (every 5 s); the handoff inbox says when new ones arrived;
// deadlines count down. Nothing here is needed to use the console: every page works without it.
(function () {
  function set(name, value) {
    document.querySelectorAll('[data-counter="' + name + '"]').forEach(function (el) {
      el.textContent = el.classList.contains("badge") ? (value ? String(value) : "") : String(value);
    });
  }
  function refresh() {
    fetch("/console/counters", { credentials: "same-origin" }).then(function (r) {
      return r.ok ? r.json() : null;
    }).then(function (c) {
      if (!c) return;
      ["unknown", "unknown_oldest_age_s", "handoffs_open", "approvals_pending", "runs_needing_person", "breakers_not_closed"].forEach(function (k) { set(k, c[k]); });
      Object.keys(c.by_status || {}).forEach(function (s) { set("by_status." + s, c.by_status[s]); });
      document.querySelectorAll("[data-watch]").forEach(function (el) {
        if (c[el.dataset.watch] > Number(el.dataset.now)) el.hidden = false;
      });
    }).catch(function () {});
  }
  function countdown() {
    document.querySelectorAll("time.countdown").forEach(function (el) {
      var left = Math.round((Date.parse(el.getAttribute("datetime")) - Date.now()) / 1000);
      el.textContent = left > 0 ? "in " + Math.floor(left / 60) + " min " + (left % 60) + " s" : "passed";
    });
  }
  if (document.querySelector("nav")) { refresh(); setInterval(refresh, 5000); }
  countdown(); setInterval(countdown, 1000);
})();
