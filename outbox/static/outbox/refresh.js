// Auto-refresh for the outbox's admin pages: off by default. When on, the page is fetched again every
// N seconds and each element marked data-refresh (by id) is replaced with its new version, so the scroll
// position, the checkboxes an operator ticked and the chosen span and interval stay as they were.
// The interval is kept in the address (?refresh=N), so a reload or a bookmark keeps it too.
(function () {
  "use strict";
  var select = document.getElementById("outbox-refresh");
  if (!select) { return; }
  var status = document.getElementById("outbox-refresh-status");
  var timer = null;

  function say(text) { if (status) { status.textContent = text; } }

  function ticked() {
    var kept = {};
    document.querySelectorAll("input[type=checkbox]:checked").forEach(function (box) {
      kept[box.name + "\u0000" + box.value] = true;
    });
    return kept;
  }

  function schedule() {
    window.clearTimeout(timer);
    var seconds = parseInt(select.value, 10);
    if (seconds > 0) { timer = window.setTimeout(refresh, seconds * 1000); }
  }

  function refresh() {
    if (document.hidden) { schedule(); return; }  // a hidden tab costs the server nothing
    fetch(window.location.href, {credentials: "same-origin", headers: {"X-Requested-With": "XMLHttpRequest"}})
      .then(function (response) {
        if (!response.ok || response.redirected) {
          throw new Error(response.redirected ? "signed out" : "the server answered " + response.status);
        }
        return response.text();
      })
      .then(function (html) {
        var fresh = new DOMParser().parseFromString(html, "text/html");
        var kept = ticked();
        document.querySelectorAll("[data-refresh]").forEach(function (part) {
          var replacement = fresh.getElementById(part.id);
          if (replacement) { part.replaceWith(document.importNode(replacement, true)); }
        });
        document.querySelectorAll("input[type=checkbox]").forEach(function (box) {
          if (kept[box.name + "\u0000" + box.value]) { box.checked = true; }
        });
        say("updated " + new Date().toLocaleTimeString());
      })
      .catch(function (error) { say("not updated: " + error.message); })
      .then(schedule);
  }

  select.addEventListener("change", function () {
    var url = new URL(window.location.href);
    if (select.value === "0") { url.searchParams.delete("refresh"); } else { url.searchParams.set("refresh", select.value); }
    window.history.replaceState(null, "", url);
    document.querySelectorAll("input[name=next]").forEach(function (next) { next.value = url.pathname + url.search; });
    document.querySelectorAll("a.outbox-keeps-refresh").forEach(function (link) {
      var target = new URL(link.href);
      if (select.value === "0") { target.searchParams.delete("refresh"); } else { target.searchParams.set("refresh", select.value); }
      link.href = target;
    });
    say(select.value === "0" ? "" : "every " + select.value + " s");
    schedule();
  });
  if (select.value !== "0") { say("every " + select.value + " s"); }
  schedule();
}());
