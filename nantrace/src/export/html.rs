//! report.html: one self-contained file (inline CSS and SVG, no script, no network: a CSP
//! forbids every fetch) with the verdict, the ranked suspects marked on a timeline of the
//! window around the first NaN, the loss curve, GPU/system counters and event lanes.
use serde_json::Value;

use crate::report::Analysis;
use crate::source::Source;

pub(super) fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

const W: f64 = 1100.0;
const LEFT: f64 = 130.0;

struct Axis {
    lo: f64,
    hi: f64,
}

impl Axis {
    fn x(&self, t: f64) -> f64 {
        LEFT + (t - self.lo) / (self.hi - self.lo).max(1e-9) * (W - LEFT - 20.0)
    }
}

fn lane_of(src: &str) -> Option<usize> {
    Source::parse(src).and_then(Source::lane)
}

const LANES: [&str; 8] = Source::LANES;

fn color(e: &Value) -> &'static str {
    match e["severity"].as_str() {
        Some("critical") => "#c0392b",
        Some("error") => "#e67e22",
        Some("warning") => "#d4ac0d",
        _ => match e["source"].as_str() {
            Some("trigger") => "#8e44ad",
            Some("log") if e["nonfinite"] == true => "#c0392b",
            Some("log") if e["fault"].is_object() => match e["fault"]["family"].as_str() {
                Some("software" | "gpu_oom") => "#2e86c1",
                Some("hang") => "#d4ac0d",
                _ => "#e67e22",
            },
            Some("log") if e["overflow"] == true => "#d4ac0d",
            Some("oom") | Some("signal") => "#e67e22",
            _ => "#5d6d7e",
        },
    }
}

/// A value for an axis label: short, with its unit.
fn fmt_val(v: f64, unit: &str) -> String {
    let a = v.abs();
    if unit == "KiB" && a >= 1_048_576.0 {
        return format!("{:.2} GiB", v / 1_048_576.0);
    }
    // Very small and very large (a diverged loss of 4.99e36) in exponent form: a label stays
    // inside its margin.
    let n = if (a != 0.0 && a < 1e-3) || a >= 1e7 {
        format!("{v:.2e}")
    } else if a >= 100.0 || v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.3}")
    };
    if unit.is_empty() {
        n
    } else {
        format!("{n} {unit}")
    }
}

/// One series in its own band: the line, its y-axis (min and max labelled, with the unit) and
/// its name in its colour, so every line's magnitude can be read.
#[expect(
    clippy::too_many_arguments,
    reason = "one series: its points, axis, place, colour, name, unit, scale"
)]
fn band(
    points: &[(f64, f64)],
    ax: &Axis,
    y0: f64,
    h: f64,
    color: &str,
    name: &str,
    unit: &str,
    log: bool,
) -> String {
    let vals: Vec<f64> = points
        .iter()
        .map(|p| if log { p.1.max(1e-12).log10() } else { p.1 })
        .collect();
    let (mn, mx) = vals
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
            (a.min(*v), b.max(*v))
        });
    if !mn.is_finite() {
        return String::new();
    }
    let span = (mx - mn).max(1e-9);
    let pts: Vec<String> = points
        .iter()
        .zip(&vals)
        .map(|(p, v)| format!("{:.1},{:.1}", ax.x(p.0), y0 + h - (v - mn) / span * h))
        .collect();
    let real = |v: f64| if log { 10f64.powf(v) } else { v };
    let (top, bottom) = (fmt_val(real(mx), unit), fmt_val(real(mn), unit));
    format!(
        r##"<g class="series" data-name="{name}"><line x1="{LEFT}" y1="{y0:.1}" x2="{LEFT}" y2="{yb:.1}" stroke="#aab7b8"/><line x1="{l5}" y1="{y0:.1}" x2="{LEFT}" y2="{y0:.1}" stroke="#aab7b8"/><line x1="{l5}" y1="{yb:.1}" x2="{LEFT}" y2="{yb:.1}" stroke="#aab7b8"/><text x="4" y="{yn:.1}" fill="{color}" class="legend">{name}{scale}</text><text x="{lt}" y="{yt:.1}" class="ylab" text-anchor="end">{top}</text><text x="{lt}" y="{yb:.1}" class="ylab" text-anchor="end">{bottom}</text><polyline fill="none" stroke="{color}" stroke-width="1.5" points="{pts}"/></g>"##,
        yb = y0 + h,
        l5 = LEFT - 4.0,
        lt = LEFT - 6.0,
        yn = y0 + h / 2.0 + 4.0,
        yt = y0 + 9.0,
        name = esc(name),
        scale = if log { " (log)" } else { "" },
        top = esc(&top),
        bottom = esc(&bottom),
        pts = pts.join(" "),
    )
}

/// What time zero is: the first NaN, the first non-finite value (an Inf before any NaN), or
/// the trigger when the log holds neither.
fn zero(timeline: &Value) -> &'static str {
    match &timeline["first_nan"] {
        Value::Null => "trigger",
        f if f["is_nan"] == false => "first non-finite value",
        _ => "first NaN",
    }
}

pub fn render(a: &Analysis, timeline: &Value, snapshot: &Value) -> String {
    let idx = Index::of(timeline);
    let svg = lanes_svg(a, timeline, &idx);
    let (loss_chart, gpu_chart, sys_chart) = charts(&idx, snapshot);
    let (order, sus) = suspects_html(a);
    let (checked, facts) = facts_html(a);
    format!(
        r#"<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; img-src data:">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>nantrace report — {host}</title>
<style>
body{{font:14px/1.4 system-ui,sans-serif;margin:16px;color:#17202a;max-width:1140px}}
h1{{font-size:20px;margin:0 0 8px}} h2{{font-size:16px;margin:18px 0 6px}} h3{{font-size:13px;margin:10px 0 2px;color:#566573}}
#verdict{{padding:10px;border-left:6px solid {vcol};background:#fdfefe;font-weight:600}}
.lane,.tick,.ylab{{font-size:11px;fill:#566573}} .legend{{font-size:11px;font-weight:600}} .nan{{font-size:11px;fill:#c0392b}} .sus{{font-size:10px;fill:#8e44ad}}
li.suspect.machine{{color:#922b21}} .fam{{font-size:11px;color:#566573}}
pre{{background:#f4f6f7;padding:8px;overflow:auto;max-height:360px;font-size:12px}}
#losses{{border-collapse:collapse;font-size:12px}} #losses td,#losses th{{border:1px solid #d5d8dc;padding:2px 8px;text-align:right}}
</style></head><body>
<h1>nantrace incident report</h1>
<div id="verdict">{verdict}</div>
<p>{reference}<br>trigger: {tkind} at {ttime}</p>
{order}<h2>Ranked suspects</h2><ol id="suspects">{sus}</ol>
<h2>Timeline (seconds relative to the {zero})</h2>
{svg}
{loss_chart}
{gpu_chart}
{sys_chart}
<h2>What was checked</h2><ul id="checked">{checked}</ul>
<h2>Facts for the ML team</h2>{facts}
</body></html>
"#,
        host = esc(timeline["host"]["hostname"].as_str().unwrap_or("?")),
        zero = zero(timeline),
        vcol = if a.machine { "#c0392b" } else { "#27ae60" },
        verdict = esc(&a.verdict),
        reference = esc(&a.reference),
        tkind = esc(timeline["trigger"]["kind"].as_str().unwrap_or("?")),
        ttime = esc(timeline["trigger"]["time"].as_str().unwrap_or("?")),
    )
}

/// Every event's time relative to the reference (the first NaN), by source, and the axis that
/// spans them. Ordered: the page is the same for the same bundle (which event's tooltip a
/// thinned marker shows, the order of the markers), so reports can be compared byte for byte.
struct Index<'a> {
    by_src: std::collections::BTreeMap<&'a str, Vec<(f64, &'a Value)>>,
    ax: Axis,
}

impl<'a> Index<'a> {
    fn of(timeline: &'a Value) -> Self {
        let evs = timeline["events"].as_array().map_or(&[][..], Vec::as_slice);
        let ref_off = timeline["first_nan"]["offset_s"].as_f64().unwrap_or(0.0);
        let rel = |e: &Value| e["offset_s"].as_f64().unwrap_or(0.0) - ref_off;
        // One pass: time and source of every event (map lookups are the cost on 100 k events).
        let mut by_src: std::collections::BTreeMap<&str, Vec<(f64, &Value)>> =
            std::collections::BTreeMap::new();
        for e in evs {
            by_src
                .entry(e["source"].as_str().unwrap_or(""))
                .or_default()
                .push((rel(e), e));
        }
        let all = || by_src.values().flatten();
        let lo = all().map(|p| p.0).fold(0.0f64, f64::min);
        let hi = all().map(|p| p.0).fold(0.0f64, f64::max).max(lo + 1.0);
        Index {
            by_src,
            ax: Axis { lo, hi },
        }
    }

    /// One counter of one source, at most ~2 points per pixel column.
    fn series(&self, src: &str, key: &str) -> Vec<(f64, f64)> {
        let v: Vec<(f64, f64)> = self
            .by_src
            .get(src)
            .into_iter()
            .flatten()
            .filter_map(|(r, e)| Some((*r, e[key].as_f64()?)))
            .filter(|p| p.1.is_finite())
            .collect();
        let step = (v.len() / 2000).max(1);
        v.into_iter().step_by(step).collect()
    }
}

const LANE_H: f64 = 26.0;
const TOP: f64 = 30.0;

/// The event lanes: a lane per kind of event, the ticks, a marker per event (thinned), time
/// zero and the suspects.
fn lanes_svg(a: &Analysis, timeline: &Value, idx: &Index<'_>) -> String {
    let (ax, lo, hi) = (&idx.ax, idx.ax.lo, idx.ax.hi);
    let (lane_h, top) = (LANE_H, TOP);
    let mut svg = String::new();
    let height = top + lane_h * LANES.len() as f64 + 30.0;
    svg.push_str(&format!(r#"<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" role="img" aria-label="event lanes">"#));
    for (i, name) in LANES.iter().enumerate() {
        let y = top + lane_h * i as f64;
        svg.push_str(&format!(r##"<rect x="{LEFT}" y="{y}" width="{}" height="{lane_h}" fill="{}"/><text x="4" y="{}" class="lane">{}</text>"##, W - LEFT - 20.0, if i % 2 == 0 { "#f4f6f7" } else { "#fbfcfc" }, y + 17.0, esc(name)));
    }
    ticks(&mut svg, ax, height);
    event_marks(&mut svg, idx);
    // Time zero (the first NaN, the first non-finite value or the trigger) and suspects.
    let x0 = ax.x(0.0);
    svg.push_str(&format!(r##"<line x1="{x0:.1}" y1="{}" x2="{x0:.1}" y2="{}" stroke="#c0392b" stroke-width="2"/><text x="{x0:.1}" y="18" class="nan">{}</text>"##, top - 6.0, height - 22.0, zero(timeline)));
    for (i, s) in a.suspects.iter().enumerate().take(9) {
        let x = ax.x(s.rel_s.clamp(lo, hi));
        svg.push_str(&format!(r##"<g class="suspect-mark"><line x1="{x:.1}" y1="{top}" x2="{x:.1}" y2="{}" stroke="#8e44ad" stroke-dasharray="4 3"/><text x="{:.1}" y="{}" class="sus">#{}</text><title>{}</title></g>"##, height - 22.0, x + 2.0, top + 10.0 + 11.0 * (i % 3) as f64, i + 1, esc(&s.text)));
    }
    svg.push_str("</svg>");
    svg
}

/// At most ~12 ticks whatever the span (a 1970 clock or an offset of 1e300 s in a hostile
/// bundle once made this loop run for ever: redteam 5.19-5.21).
fn ticks(svg: &mut String, ax: &Axis, height: f64) {
    let (lo, hi, top) = (ax.lo, ax.hi, TOP);
    let span = hi - lo;
    let step = [0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0]
        .into_iter()
        .find(|s| span / s <= 12.0)
        .unwrap_or_else(|| 10f64.powf((span / 12.0).log10().ceil()));
    if span.is_finite() && step.is_finite() && step > 0.0 {
        let first = (lo / step).ceil();
        for i in 0..=13 {
            let t = (first + f64::from(i)) * step;
            if t > hi {
                break;
            }
            let x = ax.x(t);
            svg.push_str(&format!(r##"<line x1="{x:.1}" y1="{top}" x2="{x:.1}" y2="{}" stroke="#d5d8dc"/><text x="{x:.1}" y="{}" class="tick">{t:+.1}s</text>"##, height - 22.0, height - 8.0));
        }
    }
}

/// Events (samples are counters, drawn below, not dots). A dense window is thinned to one
/// marker per lane per pixel column, so the page stays small and fast.
fn event_marks(svg: &mut String, idx: &Index<'_>) {
    let (lane_h, top) = (LANE_H, TOP);
    let mut drawn = std::collections::HashSet::new();
    for (src, list) in &idx.by_src {
        let src = *src;
        // Samples are counters (charts below): they have no lane.
        let Some(l) = lane_of(src) else { continue };
        for (r, e) in list {
            let e = *e;
            if src == "log"
                && e["nonfinite"] != true
                && e["overflow"] != true
                && !e["fault"].is_object()
            {
                continue;
            }
            let x = idx.ax.x(*r);
            let col = color(e);
            if !drawn.insert((l, x as i64, col)) {
                continue;
            }
            let y = top + lane_h * l as f64 + lane_h / 2.0;
            let label = e["text"]
                .as_str()
                .or(e["line"].as_str())
                .or(e["reason"].as_str())
                .or(e["change"].as_str())
                .unwrap_or(src);
            svg.push_str(&format!(r#"<circle class="ev" cx="{x:.1}" cy="{y:.1}" r="4" fill="{col}"><title>{} {:+.3}s {}</title></circle>"#, esc(src), r, esc(&label.chars().take(200).collect::<String>())));
        }
    }
}

/// (points, colour, name, unit, log scale): each series in its own labelled band.
type Series<'a> = (Vec<(f64, f64)>, &'a str, &'a str, &'a str, bool);

/// One counter chart: a band per series with enough points, time zero across.
fn chart(ax: &Axis, id: &str, title: &str, lines: Vec<Series<'_>>) -> String {
    let x0 = ax.x(0.0);
    let bh = 46.0;
    let shown: Vec<&Series> = lines.iter().filter(|l| l.0.len() >= 2).collect();
    let h = (bh + 8.0) * shown.len().max(1) as f64;
    let mut c = format!(
        r#"<h3>{}</h3><svg id="{id}" xmlns="http://www.w3.org/2000/svg" width="{W}" height="{}">"#,
        esc(title),
        h + 12.0
    );
    c.push_str(&format!(
        r##"<rect x="{LEFT}" y="5" width="{}" height="{h}" fill="#fbfcfc" stroke="#d5d8dc"/>"##,
        W - LEFT - 20.0
    ));
    for (i, (pts, col, name, unit, log)) in shown.iter().enumerate() {
        c.push_str(&band(
            pts,
            ax,
            9.0 + (bh + 8.0) * i as f64,
            bh,
            col,
            name,
            unit,
            *log,
        ));
    }
    if shown.is_empty() {
        c.push_str(&format!(
            r#"<text x="{}" y="30" class="lane">no data in this window</text>"#,
            LEFT + 10.0
        ));
    }
    c.push_str(&format!(
        r##"<line x1="{x0:.1}" y1="5" x2="{x0:.1}" y2="{}" stroke="#c0392b"/></svg>"##,
        h + 5.0
    ));
    c
}

/// The loss, GPU and system charts.
fn charts(idx: &Index<'_>, snapshot: &Value) -> (String, String, String) {
    let series = |src: &str, key: &str| idx.series(src, key);
    let chart = |id: &str, title: &str, lines: Vec<Series>| chart(&idx.ax, id, title, lines);
    let loss_chart = chart(
        "loss",
        "Loss and fp16 loss scale",
        vec![
            (series("log", "loss"), "#1f618d", "loss", "", true),
            (
                series("log", "loss_scale"),
                "#d4ac0d",
                "loss scale",
                "",
                true,
            ),
        ],
    );
    let gpu_note = if snapshot["gpu"]["available"] == true {
        String::new()
    } else {
        format!(
            " — {}",
            snapshot["gpu"]["reason"].as_str().unwrap_or("no GPU data")
        )
    };
    let gpu_chart = chart(
        "gpu",
        &format!("GPU temperature, power, utilization{gpu_note}"),
        vec![
            (
                series("gpu", "temp_c"),
                "#c0392b",
                "temperature",
                "°C",
                false,
            ),
            (series("gpu", "power_w"), "#e67e22", "power", "W", false),
            (
                series("gpu", "util_gpu_pct"),
                "#27ae60",
                "utilization",
                "%",
                false,
            ),
        ],
    );
    let sys_chart = chart(
        "system",
        "Memory available, swap-in, iowait",
        vec![
            (
                series("system", "mem_available_kb"),
                "#1f618d",
                "mem available",
                "KiB",
                false,
            ),
            (
                series("system", "swap_in_kb_s"),
                "#c0392b",
                "swap-in",
                "KiB/s",
                false,
            ),
            (
                series("system", "iowait_pct"),
                "#7d3c98",
                "iowait",
                "%",
                false,
            ),
        ],
    );
    (loss_chart, gpu_chart, sys_chart)
}

/// The cause and its consequences, when the log shows both, and the ranked suspects.
fn suspects_html(a: &Analysis) -> (String, String) {
    let mut sus = String::new();
    if a.suspects.is_empty() {
        sus.push_str("<li class=\"none\">none: no signal in the table fired</li>");
    }
    for (i, s) in a.suspects.iter().enumerate() {
        sus.push_str(&format!(
            r#"<li class="suspect {}"><b>#{}</b> <span class="fam">{}</span> sev {} {}</li>"#,
            if s.blames_machine() {
                "machine"
            } else {
                "numerics"
            },
            i + 1,
            esc(s.family.label()),
            s.severity,
            esc(&s.text)
        ));
    }
    // The job's first failure and its consequences, when the log shows both.
    let order: String = a.order.as_ref().map_or(String::new(), |o| {
        let items: String = crate::report::order_lines(o)
            .iter()
            .map(|l| format!("<li>{}</li>", esc(l)))
            .collect();
        format!("<h2>Cause and consequences</h2><ul id=\"order\">{items}</ul>")
    });
    (order, sus)
}

/// What was checked, and the facts as the ML team reads them (versions, precision,
/// scheduler, limits, the last losses), the JSON one click away.
fn facts_html(a: &Analysis) -> (String, String) {
    let checked: String = a
        .checked
        .iter()
        .map(|c| format!("<li>{}</li>", esc(c)))
        .collect();
    // The facts as the ML team reads them (versions, precision, scheduler, limits, the last
    // losses), the JSON one click away.
    let (fact_lines, losses) = crate::report::facts_lines(&a.facts);
    let mut facts: String = fact_lines
        .iter()
        .map(|l| format!("<li>{}</li>", esc(l)))
        .collect();
    facts = format!("<ul id=\"facts\">{facts}</ul>");
    if !losses.is_empty() {
        facts.push_str(
            "<table id=\"losses\"><tr><th>step</th><th>loss</th><th>t (s, vs trigger)</th></tr>",
        );
        for (step, loss, t) in &losses {
            facts.push_str(&format!(
                "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
                esc(step),
                esc(loss),
                esc(t)
            ));
        }
        facts.push_str("</table>");
    }
    facts.push_str(&format!(
        "<details><summary>all facts as JSON</summary><pre id=\"facts-json\">{}</pre></details>",
        esc(&serde_json::to_string_pretty(&a.facts).unwrap_or_default())
    ));
    (checked, facts)
}

#[cfg(test)]
mod tests {

    #[test]
    fn axis_labels_of_huge_or_tiny_values_stay_short() {
        assert_eq!(super::fmt_val(4.99e36, ""), "4.99e36");
        assert_eq!(super::fmt_val(65536.0, ""), "65536");
        assert_eq!(super::fmt_val(0.0001234, "s"), "1.23e-4 s");
    }
    use serde_json::json;

    #[test]
    fn every_chart_line_has_its_own_labelled_axis_and_legend() {
        let mut evs = Vec::new();
        for i in 0..20 {
            let t = -20.0 + f64::from(i);
            evs.push(json!({ "offset_s": t, "source": "log", "loss": 2.0 - f64::from(i) * 0.05, "loss_scale": 65536.0 / f64::from(1 + i % 3), "line": "x" }));
            evs.push(json!({ "offset_s": t, "source": "system", "mem_available_kb": 20_000_000 - i * 1000, "swap_in_kb_s": 0.0, "iowait_pct": 1.5 + f64::from(i) }));
        }
        let t = json!({ "first_nan": { "offset_s": 0.0 }, "events": evs, "accounting": {} });
        let a = crate::report::analyze(&t, &json!({}));
        let html = super::render(&a, &t, &json!({}));
        for name in [
            "loss (log)",
            "loss scale (log)",
            "mem available",
            "swap-in",
            "iowait",
        ] {
            assert!(html.contains(&format!(">{name}</text>")), "legend {name}");
        }
        // The y-axis labels carry magnitudes and units.
        assert!(
            html.contains(">19.07 GiB</text>") && html.contains(">19.06 GiB</text>"),
            "memory axis"
        );
        assert!(
            html.contains(">20.500 %</text>") && html.contains(">1.500 %</text>"),
            "iowait axis"
        );
        assert!(html.contains(">65536</text>"), "loss scale axis");
        assert_eq!(
            html.matches("class=\"series\"").count(),
            5,
            "one band per series with data (no GPU here)"
        );
    }

    /// The facts for the ML team are readable facts (versions, precision, scheduler, limits,
    /// the last losses), the JSON behind a click; time zero is named for what it is.
    #[test]
    fn the_facts_are_readable_and_the_json_one_click_away() {
        let evs: Vec<_> = (0..5).map(|i| json!({ "offset_s": -5.0 + f64::from(i), "source": "log", "step": i, "loss": 1.5, "line": format!("step {i} loss 1.5") })).collect();
        let t = json!({ "first_nan": { "offset_s": 0.0, "line": "step 5 | loss 4.9e36 | grad_norm inf", "what": "grad_norm = inf", "is_nan": false }, "job": { "root_pid": 7, "command": ["python", "train.py"], "exit_code": 1 }, "events": evs, "accounting": {} });
        let snap = json!({ "software": { "nvidia_driver": "550.54.15", "env": { "NVIDIA_TF32_OVERRIDE": "0" } }, "scheduler": { "slurm": { "job_id": "42" } } });
        let a = crate::report::analyze(&t, &snap);
        let html = super::render(&a, &t, &snap);
        let facts = &html[html.find("<ul id=\"facts\">").expect("facts as a list")..];
        for want in [
            "<li>command: python train.py (pid 7), exit: code 1</li>",
            "<li>NVIDIA driver: 550.54.15</li>",
            "NVIDIA_TF32_OVERRIDE",
            "<li>scheduler: slurm=42 kubernetes=none cgroup memory limit=unlimited</li>",
            "<table id=\"losses\">",
            "<td>1.5</td>",
            "<details><summary>all facts as JSON</summary><pre id=\"facts-json\">",
        ] {
            assert!(facts.contains(want), "{want}: {facts}");
        }
        assert!(
            facts.find("<details>").unwrap() > facts.find("<table").unwrap(),
            "the JSON comes after the readable facts"
        );
        assert!(
            html.contains("Timeline (seconds relative to the first non-finite value)")
                && a.reference
                    .starts_with("first non-finite value (grad_norm = inf; no NaN yet)"),
            "{}",
            a.reference
        );
    }
}
