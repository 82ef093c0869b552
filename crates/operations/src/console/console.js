// The idemgate console: a thin page over the admin API (same origin, the
// session cookie set at sign-in; every call says it comes from the console,
// which a page on another site cannot forge).
"use strict";

const view = document.getElementById("view");

async function api(method, path, body) {
  const init = { method, credentials: "same-origin", headers: { "X-Idemgate-Console": "1" } };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch("/admin/v1/" + path, init);
  if (response.status === 401) {
    window.location.href = "/console/";
    throw new Error("signed out");
  }
  const data = await response.json().catch(() => ({}));
  if (!response.ok) {
    const error = new Error(data.detail || data.title || ("HTTP " + response.status));
    error.status = response.status;
    throw error;
  }
  return data;
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null) continue;
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value);
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const badge = (state, text) => el("span", { class: "badge " + state, "data-state": state }, text || state);
// Every time on every page one way: UTC, to the second, as the gateway
// logs it; the reader's local time on hover.
const utcText = (t) => new Date(t).toISOString().replace("T", " ").replace(/\.\d+Z$/, " UTC");
const when = (t) => (t
  ? el("time", { datetime: t, title: new Date(t).toLocaleString() + " (your time)" }, utcText(t))
  : "—");
// How long ago, for a listing: "42 s", "5 min", "3 h", "2 d".
function age(t) {
  const s = Math.max(0, Math.round((Date.now() - Date.parse(t)) / 1000));
  const [n, unit] = s < 120 ? [s, "s"] : s < 7200 ? [Math.round(s / 60), "min"]
    : s < 172800 ? [Math.round(s / 3600), "h"] : [Math.round(s / 86400), "d"];
  return el("span", { class: "age", title: utcText(t) }, n + " " + unit);
}
// A long value (an owner, an id) cut to its start, the whole on hover.
const cut = (text, keep) => el("span", { class: "mono cut", title: text },
  text.length > keep + 1 ? text.slice(0, keep) + "…" : text);
const notice = (kind, text) => el("div", { class: "notice " + kind, role: kind === "error" ? "alert" : "status" }, text);

function show(...nodes) {
  view.replaceChildren(...nodes.flat().filter((n) => n !== null && n !== undefined && n !== false));
}

function activate(name) {
  for (const a of document.querySelectorAll("header nav a")) {
    a.classList.toggle("active", a.id === "nav-" + name);
  }
}

// The operator's inbox: jobs whose outcome only a person can settle;
// `flash` says what was just done (a bulk resolution).
async function inbox(before, flash) {
  activate("inbox");
  show(el("h1", {}, "Unknown jobs"), el("p", { class: "muted" }, "Loading…"));
  const query = "jobs?state=unknown&limit=25" + (before ? "&before=" + encodeURIComponent(before) : "");
  let page;
  try {
    page = await api("GET", query);
  } catch (e) {
    return show(el("h1", {}, "Unknown jobs"), notice("error", e.message));
  }
  const rows = page.jobs.map((job) => {
    const unknown = job.unknown_attempts || [];
    return el("tr", { "data-job": job.id },
      el("td", { class: "key" }, el("a", { href: "#/jobs/" + job.id, class: "mono", title: "job " + job.id }, job.key)),
      el("td", { class: "upstream" }, unknown.map((a) => a.upstream).join(", ") || "—"),
      el("td", {}, age(job.created_at)),
      el("td", {}, when(job.created_at)),
      el("td", {}, job.route),
      el("td", { class: "owner" }, cut(job.owner, 14)),
      el("td", {}, String(job.attempt_count)));
  });
  show(
    el("h1", {}, "Unknown jobs"),
    flash,
    el("p", { class: "muted" },
      "An attempt of each of these jobs may have acted upstream, and nobody knows whether it did. " +
      "Retries with their keys are refused until someone says what happened. Newest first."),
    rows.length ? bulkResolver() : null,
    rows.length
      ? el("table", { id: "inbox" },
          el("thead", {}, el("tr", {}, ["Key", "Upstream", "Age", "Created (UTC)", "Route", "Owner", "Attempts"].map((h) => el("th", {}, h)))),
          el("tbody", {}, rows))
      : el("div", { class: "card", id: "inbox-empty" }, "No job is unknown. Nothing waits for you."),
    page.next ? el("div", { class: "actions" }, el("button", { id: "older", onclick: () => inbox(page.next) }, "Older")) : null);
}

// RFC 3339 in UTC to the second, as the admin API reads it.
const utc = (ms) => new Date(ms).toISOString().replace(/\.\d+Z$/, "Z");
// The API's exact bounds (nanoseconds), shown to the millisecond.
const shown = (t) => t.replace(/(\.\d{3})\d*Z$/, "$1Z").replace(/\.000Z$/, "Z");
const plural = (n, one) => n + " " + one + (n === 1 ? "" : "s");

const BULK_OUTCOMES = {
  failed: {
    label: "Had no effect",
    recorded: "recorded as failed: the upstream did nothing with any of them",
  },
  cancelled: {
    label: "Cancelled (abandoned)",
    recorded: "recorded as cancelled: abandoned, whatever they did",
  },
};

// The upstream field: a select of the configured upstreams (the API lists
// them), or free text should that list not load.
function upstreamField() {
  const holder = el("div", {}, el("label", { for: "bulk-upstream" }, "Upstream"),
    el("select", { id: "bulk-upstream", required: "" }, el("option", { value: "" }, "Loading…")));
  api("GET", "upstreams").then((data) => {
    holder.querySelector("#bulk-upstream").replaceChildren(
      ...data.upstreams.map((u) => el("option", { value: u.name }, u.name)));
  }).catch(() => {
    holder.querySelector("#bulk-upstream").replaceWith(el("input", { id: "bulk-upstream", size: 16, required: "" }));
  });
  return holder;
}

// Bulk resolution after an outage of one upstream (docs/design.md, §14):
// every unknown attempt sent to it that started in a window, marked as
// having had no effect or cancelled, through POST /admin/v1/attempts/resolve.
// A preview (the API's dry run) comes first, and "Resolve" is offered only
// for the inputs previewed; it sends back the window's end the preview read,
// so attempts started since are not swept in unseen.
function bulkResolver() {
  const message = el("div", { id: "bulk-message" });
  const listing = el("div", { id: "bulk-preview" });
  const since = el("input", { id: "bulk-since", size: 24, required: "", value: utc(Date.now() - 3600e3) });
  const until = el("input", { id: "bulk-until", size: 24, placeholder: "now" });
  const outcome = el("select", { id: "bulk-outcome" },
    Object.entries(BULK_OUTCOMES).map(([value, o]) => el("option", { value }, o.label)));
  const resolve = el("button", { type: "button", class: "danger", id: "bulk-resolve", disabled: "" }, "Resolve");
  let previewed = null;
  const inputs = () => ({
    upstream: form.querySelector("#bulk-upstream").value.trim(),
    since: since.value.trim(),
    until: until.value.trim() || undefined,
    outcome: outcome.value,
  });
  const same = () => previewed !== null && JSON.stringify(inputs()) === previewed.key;
  const stale = () => {
    if (previewed === null || same()) return;
    previewed = null;
    resolve.disabled = true;
    resolve.textContent = "Resolve";
    listing.replaceChildren(notice("status", "The inputs changed: preview again."));
  };
  const preview = async (e) => {
    e.preventDefault();
    const request = inputs();
    message.replaceChildren();
    try {
      const answer = await api("POST", "attempts/resolve", { ...request, dry_run: true });
      previewed = { key: JSON.stringify(request), request, until: answer.until, count: answer.matched.length };
      listing.replaceChildren(matchedList(request, answer));
      resolve.disabled = previewed.count === 0;
      resolve.textContent = "Resolve " + plural(previewed.count, "attempt");
    } catch (err) {
      previewed = null;
      resolve.disabled = true;
      listing.replaceChildren();
      message.replaceChildren(notice("error", err.message));
    }
  };
  const run = async () => {
    if (!same()) return stale();
    const { request, until: end, count } = previewed;
    resolve.disabled = true;
    try {
      const done = await api("POST", "attempts/resolve", { ...request, until: end, dry_run: false });
      inbox(undefined, bulkDone(request, count, done));
    } catch (err) {
      resolve.disabled = false;
      message.replaceChildren(notice("error", err.message));
    }
  };
  resolve.addEventListener("click", () => {
    if (!same()) return stale();
    const { request, count } = previewed;
    confirmThen(`Resolve ${plural(count, "attempt")} on ${request.upstream}?`,
      `${plural(count, "unknown attempt")} sent to ${request.upstream} that started from ${request.since} ` +
      `to ${shown(previewed.until)} will be ${BULK_OUTCOMES[request.outcome].recorded}. Their jobs reopen: each ` +
      "client's next retry with its key runs a new attempt against the upstream. One settled meanwhile is " +
      "skipped. This cannot be undone.", run);
  });
  const form = el("form", { id: "bulk-form", onsubmit: preview, oninput: stale, onchange: stale },
    el("div", { class: "fields" },
      upstreamField(),
      el("div", {}, el("label", { for: "bulk-since" }, "Started at or after (UTC)"), since),
      el("div", {}, el("label", { for: "bulk-until" }, "Started before (UTC)"), until),
      el("div", {}, el("label", { for: "bulk-outcome" }, "Resolution"), outcome)),
    el("p", { class: "muted" }, "Times are RFC 3339 in UTC, as the gateway logs them: 2026-12-01T10:00:00Z. " +
      "Leave \"started before\" empty for now."),
    el("div", { class: "actions" }, el("button", { type: "submit", id: "bulk-preview-button" }, "Preview"), resolve));
  return el("details", { class: "bulk", id: "bulk" },
    el("summary", {}, "Resolve many (after an outage of one upstream)"),
    el("p", {}, "Every unknown attempt sent to one upstream that started in a window, settled with one answer. " +
      "Only \"had no effect\" or \"cancelled\": one response cannot be every attempt's. Both reopen the jobs."),
    message, form, listing);
}

// What a dry run matched: how many, and which jobs (the first 100 listed),
// and whether it stopped before the window's oldest unknown jobs.
function matchedList(request, answer) {
  const matched = answer.matched;
  if (!matched.length) {
    return el("div", {}, truncatedNotice(answer),
      el("div", { class: "card", id: "bulk-count", "data-count": "0" },
        `No unknown attempt sent to ${request.upstream} started from ${shown(answer.since)} to ${shown(answer.until)}` +
        (answer.truncated ? " among the unknown jobs read." : ".")));
  }
  const rows = matched.slice(0, 100);
  return el("div", {}, truncatedNotice(answer),
    el("div", { class: "notice status", id: "bulk-count", "data-count": String(matched.length) },
      `${plural(matched.length, "attempt")} would change: unknown, sent to ${request.upstream}, ` +
      `started from ${shown(answer.since)} to ${shown(answer.until)}. Nothing is changed yet.`),
    el("table", { id: "bulk-matched" },
      el("thead", {}, el("tr", {}, ["Key", "Job", "Attempt", "Started (UTC)"].map((h) => el("th", {}, h)))),
      el("tbody", {}, rows.map((m) => el("tr", { "data-job": m.job, "data-attempt": m.attempt },
        el("td", { class: "mono key" }, m.key),
        el("td", {}, el("a", { href: "#/jobs/" + m.job }, cut(m.job, 13))),
        el("td", {}, cut(m.attempt, 13)),
        el("td", {}, when(m.started_at)))))),
    matched.length > rows.length
      ? el("p", { class: "muted" }, `… and ${matched.length - rows.length} more.`) : null);
}

// A bulk answer that stopped at its cap of unknown jobs (newest first) may
// leave out older attempts in the window: said, with what to do.
function truncatedNotice(answer) {
  if (!answer.truncated) return null;
  return el("div", { class: "notice error", id: "bulk-truncated" },
    "Stopped early: there are more unknown jobs than one call reads (the newest are read first), " +
    "so older attempts in this window may be missing. Resolve newer ones first, then preview again.");
}

// The inbox's notice after a bulk resolution: what was resolved, what was
// skipped and why, and whether the set differed from the preview.
function bulkDone(request, previewedCount, done) {
  const resolved = done.resolved.length;
  const lines = [el("div", { id: "bulk-done", "data-resolved": String(resolved) },
    `Resolved ${resolved} of ${plural(done.matched.length, "attempt")} on ${request.upstream}: their jobs are open again.`)];
  if (done.matched.length !== previewedCount) {
    lines.push(el("div", {}, `The preview matched ${previewedCount}: ` +
      "since then, attempts in the window were settled or went unknown."));
  }
  for (const s of done.skipped) lines.push(el("div", {}, `Skipped attempt ${s.attempt}: ${s.why}`));
  if (done.truncated) lines.push(truncatedNotice(done));
  return el("div", { class: "notice " + (done.skipped.length ? "error" : "ok"), role: "status" }, lines);
}

function find() {
  activate("find");
  const byId = el("form", { class: "inline", id: "find-by-id", onsubmit: (e) => {
    e.preventDefault();
    const id = byId.querySelector("input").value.trim();
    if (id) location.hash = "#/jobs/" + id;
  } },
    el("div", {}, el("label", { for: "job-id" }, "Job id"), el("input", { id: "job-id", size: 40, placeholder: "0190…" })),
    el("button", { class: "primary", type: "submit" }, "Open"));
  const byKey = el("form", { class: "inline", id: "find-by-key", onsubmit: async (e) => {
    e.preventDefault();
    const owner = byKey.querySelector("#owner").value.trim() || "anonymous";
    const key = byKey.querySelector("#key").value;
    try {
      const job = await api("GET", "jobs?owner=" + encodeURIComponent(owner) + "&key=" + encodeURIComponent(key));
      location.hash = "#/jobs/" + job.id;
    } catch (err) {
      result.replaceChildren(notice("error", err.message));
    }
  } },
    el("div", {}, el("label", { for: "owner" }, "Owner"),
      el("input", { id: "owner", size: 36, placeholder: "hmac:… (as a job shows it), anonymous, or the Authorization value" })),
    el("div", {}, el("label", { for: "key" }, "Idempotency-Key"), el("input", { id: "key", size: 28, required: "" })),
    el("button", { class: "primary", type: "submit" }, "Find"));
  const result = el("div", {});
  show(el("h1", {}, "Find a job"),
    el("div", { class: "card" }, byId), el("h2", {}, "By owner and key"), el("div", { class: "card" }, byKey), result);
}

// Who settled an attempt, said plainly: an operator's answer is the
// operator's (who, when), never the upstream's.
function decided(a) {
  if (a.resolved_by) {
    const what = { succeeded: "it took effect (the response below is the operator's)",
      failed: "it had no effect", cancelled: "abandoned" }[a.state] || a.state;
    return el("span", { class: "decided", id: "decided-" + a.number },
      "resolved by ", el("strong", {}, a.resolved_by.operator), " at ", when(a.resolved_by.at), ": " + what);
  }
  return a.upstream_status ? "upstream answered " + a.upstream_status : null;
}

// The lookups of an attempt (docs/design.md §5): how many, the last, and
// the next or why none follows.
function lookupsOf(a) {
  const l = a.lookups || {};
  if (!l.count && !l.next_at && !l.stopped) return null;
  const parts = [plural(l.count || 0, "lookup")];
  if (l.last) {
    parts.push(" · last ", when(l.last.at), ": " + l.last.result.replace(/_/g, " ") +
      (l.last.status ? " (" + l.last.status + ")" : " (no answer)"));
  }
  if (l.next_at) {
    parts.push(Date.parse(l.next_at) < Date.now() ? " · next overdue since " : " · next at ", when(l.next_at));
  }
  if (l.stopped) parts.push(" · stopped: " + l.stopped);
  return el("div", { class: "lookups", id: "lookups-" + a.number, "data-count": String(l.count || 0) }, parts);
}

// Attempts on one time axis, from the first start to the last end (or now).
// An attempt an operator settled is drawn as waiting on the operator, not
// as a call that ran until they answered.
function timeline(job) {
  const start = Math.min(...job.attempts.map((a) => Date.parse(a.started_at)));
  const end = Math.max(Date.now() > start ? Math.min(Date.now(), start + 3600e3) : start + 1,
    ...job.attempts.map((a) => Date.parse(a.finished_at || a.started_at)));
  const span = Math.max(end - start, 1);
  const lanes = job.attempts.map((a) => {
    const from = Date.parse(a.started_at);
    const to = a.finished_at ? Date.parse(a.finished_at) : end;
    const left = (100 * (from - start)) / span;
    const width = Math.max((100 * (to - from)) / span, 0.5);
    const won = job.completed_by === a.id;
    const drawn = a.resolved_by ? "operator" : a.state;
    return el("div", { class: "lane", "data-attempt": a.id, "data-number": a.number, "data-state": a.state,
      "data-decided": a.resolved_by ? "operator" : null },
      el("div", { class: "who" },
        el("strong", {}, "#" + a.number), " ", a.upstream, " ",
        a.resolved_by ? badge("operator", "resolved: " + a.state) : badge(a.state),
        won ? el("span", { class: "winner", title: "its answer is the job's result" }, " ★ winner") : null),
      el("div", { class: "track", title: utcText(a.started_at) + " → " + (a.finished_at ? utcText(a.finished_at) : "still running") },
        el("div", { class: "bar " + drawn, style: `left:${left}%;width:${width}%` })),
      el("div", { class: "why" },
        when(a.started_at), " → ", a.finished_at ? when(a.finished_at) : "not finished",
        decided(a) ? [" · ", decided(a)] : null,
        a.detail && !a.resolved_by ? " · " + a.detail : ""),
      lookupsOf(a));
  });
  return el("div", { class: "timeline", id: "timeline" }, lanes);
}

function header(response, name) {
  const found = (response.headers || []).find(([n]) => n.toLowerCase() === name);
  return found ? found[1] : "";
}

// The stored response; `typedBy` is the winning attempt's resolution when
// an operator typed it (then it is said: no upstream sent it).
function storedResponse(response, typedBy) {
  if (!response) return el("div", { class: "card muted", id: "response" }, "No response is stored: the job has no result yet.");
  const type = header(response, "content-type");
  let body;
  if (response.body === undefined) {
    const size = Math.floor((response.body_base64 || "").length * 3 / 4);
    body = el("p", { class: "muted", id: "body-binary" }, `Binary body: about ${size} bytes of ${type || "unknown type"}.`);
  } else {
    let text = response.body;
    if (/json/.test(type)) {
      try { text = JSON.stringify(JSON.parse(text), null, 2); } catch (_) { /* shown as sent */ }
    }
    const cut = text.length > 65536;
    body = el("pre", { class: "body", id: "body" }, cut ? text.slice(0, 65536) + "\n… (cut: " + text.length + " characters)" : text);
  }
  return el("div", { class: "card", id: "response" },
    typedBy ? el("p", { class: "notice status", id: "response-typed" }, "Typed by ", el("strong", {}, typedBy.operator),
      " at ", when(typedBy.at), ": what the operator said the upstream answered, not an answer the gateway received.") : null,
    el("dl", { class: "facts" }, el("dt", {}, "Status"), el("dd", { id: "response-status" }, String(response.status))),
    el("h2", {}, "Headers"),
    el("table", {}, el("tbody", {}, (response.headers || []).map(([n, v]) => el("tr", {}, el("td", { class: "mono" }, n), el("td", { class: "mono" }, v))))),
    el("h2", {}, "Body"), body);
}

function confirmThen(title, text, action) {
  const dialog = document.getElementById("confirm");
  document.getElementById("confirm-title").textContent = title;
  document.getElementById("confirm-text").textContent = text;
  dialog.returnValue = "";
  dialog.onclose = () => { if (dialog.returnValue === "ok") action(); };
  dialog.showModal();
}

function resolver(job, attempt, done) {
  const next = job.attempt_count + 1;
  const message = el("div", {});
  const run = async (resolution) => {
    try {
      await api("POST", "attempts/" + attempt.id + "/resolve", resolution);
      done("Resolved. " + (resolution.outcome === "failed"
        ? "The job is open again: the next retry runs attempt " + next + "."
        : "The job is completed: retries replay this response."));
    } catch (e) {
      message.replaceChildren(notice("error", e.message));
    }
  };
  const status = el("input", { id: "resolve-status", type: "number", min: 200, max: 599, value: 200, required: "" });
  const headers = el("textarea", { id: "resolve-headers", rows: 3 }, "content-type: application/json");
  const body = el("textarea", { id: "resolve-body", rows: 6, placeholder: "the response the client's retries will get" });
  const succeeded = el("form", { id: "resolve-succeeded", onsubmit: (e) => {
    e.preventDefault();
    const lines = headers.value.split("\n").map((l) => l.trim()).filter(Boolean);
    const pairs = [];
    for (const line of lines) {
      const at = line.indexOf(":");
      if (at < 1) return message.replaceChildren(notice("error", "Each header line is `name: value`: " + line));
      pairs.push([line.slice(0, at).trim(), line.slice(at + 1).trim()]);
    }
    const response = { status: Number(status.value), headers: pairs, body: body.value };
    confirmThen("Complete the job with this response?",
      `Attempt #${attempt.number} will be recorded as succeeded with status ${response.status}. ` +
      "The job completes: every retry with this key gets this response, replayed, and the upstream is not called again. " +
      "This cannot be undone.",
      () => run({ outcome: "succeeded", response }));
  } },
    el("div", { class: "inline form" }, el("div", {}, el("label", { for: "resolve-status" }, "Status"), status)),
    el("label", { for: "resolve-headers" }, "Headers (one `name: value` per line)"), headers,
    el("label", { for: "resolve-body" }, "Body"), body,
    el("div", { class: "actions" }, el("button", { class: "primary", type: "submit", id: "succeeded" }, "Succeeded with this response")));
  return el("div", { class: "resolve", id: "resolve" },
    el("h2", {}, `Attempt #${attempt.number} has an unknown outcome`),
    el("p", {}, "It may have acted upstream (a charge made, a job started), or not. Check the upstream, then say which."),
    message,
    el("div", { class: "actions" },
      el("button", { class: "danger", id: "no-effect", onclick: () => confirmThen(
        "Mark the attempt as having had no effect?",
        `Attempt #${attempt.number} will be recorded as failed. The job reopens: the client's next retry with this key ` +
        `runs attempt ${next} against the upstream. Only do this if the upstream did nothing.`,
        () => run({ outcome: "failed" })) }, "Had no effect")),
    el("h2", {}, "Or: it succeeded, with this response"), succeeded);
}

async function jobPage(id, flash) {
  activate("");
  let job;
  try {
    job = await api("GET", "jobs/" + encodeURIComponent(id));
  } catch (e) {
    return show(el("h1", {}, "Job"), notice("error", e.message));
  }
  const unknown = job.attempts.filter((a) => a.state === "unknown");
  show(
    el("h1", {}, "Job ", el("span", { class: "mono", id: "job-id-title" }, job.id), " ", el("span", { id: "job-state" }, badge(job.state))),
    flash ? notice("ok", flash) : null,
    el("div", { class: "card" }, el("dl", { class: "facts" },
      el("dt", {}, "Key"), el("dd", { class: "mono", id: "job-key" }, job.key),
      el("dt", {}, "Owner"), el("dd", { class: "mono" }, job.owner),
      el("dt", {}, "Route"), el("dd", {}, job.route),
      el("dt", {}, "Fingerprint"), el("dd", { class: "mono" }, job.fingerprint),
      el("dt", {}, "Created"), el("dd", {}, when(job.created_at)),
      el("dt", {}, "Expires"), el("dd", {}, when(job.expires_at)),
      el("dt", {}, "Version"), el("dd", {}, String(job.version)))),
    el("h2", {}, `Attempts (${job.attempts.length})`), timeline(job),
    unknown.map((a) => resolver(job, a, (text) => jobPage(id, text))),
    el("h2", {}, "Stored response"),
    storedResponse(job.response, (job.attempts.find((a) => a.id === job.completed_by) || {}).resolved_by));
}

// One contract's standing on an upstream: whether failover may use it (and
// how many passing verifications it still needs), the last verdict's
// failures, and the last verdicts, newest first (docs/design.md §6).
function standing(c) {
  const eligible = c.eligible
    ? badge("succeeded", "eligible")
    : badge("failed", c.needed > 0 && c.passes_in_a_row > 0
      ? `not eligible: ${c.needed} more passing`
      : "not eligible");
  const history = (c.history || []).map((v) =>
    el("span", { class: `verdict verdict-${v.result}`, title: v.checked_at ? utcText(v.checked_at) : "" }, v.result));
  return el("div", { class: "standing", "data-contract": c.contract },
    eligible, " ", c.contract, " ",
    el("span", { class: "muted" }, c.checked_at ? ["checked ", when(c.checked_at)] : "not checked yet"),
    (c.failures || []).map((f) => el("div", { class: "muted failure" }, f.probe + ": " + f.why)),
    history.length ? el("div", { class: "history" }, el("span", { class: "muted" }, "last verdicts: "), history) : []);
}

async function upstreams() {
  activate("upstreams");
  let data;
  try {
    data = await api("GET", "upstreams");
  } catch (e) {
    return show(el("h1", {}, "Upstreams"), notice("error", e.message));
  }
  const rows = data.upstreams.map((u) => el("tr", { "data-upstream": u.name },
    el("td", {}, el("strong", {}, u.name)), el("td", { class: "mono" }, u.url),
    el("td", {}, u.contracts.length ? u.contracts.map(standing) : el("span", { class: "muted" }, "no contract probes"))));
  show(el("h1", {}, "Upstreams"),
    el("table", { id: "upstreams" }, el("thead", {}, el("tr", {}, ["Name", "URL", "Contract probes"].map((h) => el("th", {}, h)))), el("tbody", {}, rows)));
}

function route() {
  const [, page, arg] = location.hash.split("/");
  if (page === "jobs" && arg) return jobPage(decodeURIComponent(arg));
  if (page === "find") return find();
  if (page === "upstreams") return upstreams();
  return inbox();
}

window.addEventListener("hashchange", route);
route();
