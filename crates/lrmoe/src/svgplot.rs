//! Minimal SVG line charts (no font or raster dependencies).

use std::fmt::Write as _;

/// One named polyline.
pub struct Series<'a> {
    /// Legend label.
    pub name: &'a str,
    /// Points `(x, y)`.
    pub points: Vec<(f64, f64)>,
}

/// A line chart with axes, ticks, a legend and an optional dashed
/// horizontal reference line `(y, label)`.
pub fn lines(
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series<'_>],
    reference: Option<(f64, &str)>,
) -> String {
    let (w, h, m) = (720.0, 440.0, 60.0);
    let all = series.iter().flat_map(|s| s.points.iter());
    let x_max = all.clone().map(|p| p.0).fold(1e-9, f64::max);
    let x_min = all.clone().map(|p| p.0).fold(x_max, f64::min).min(0.0);
    let mut y_min = all.clone().map(|p| p.1).fold(f64::INFINITY, f64::min);
    let mut y_max = all.map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
    if let Some((r, _)) = reference {
        y_min = y_min.min(r);
        y_max = y_max.max(r);
    }
    if !y_min.is_finite() {
        (y_min, y_max) = (0.0, 1.0);
    }
    let pad = ((y_max - y_min) * 0.05).max(1e-9);
    let (y_min, y_max) = (y_min - pad, y_max + pad);
    let x = |v: f64| m + (w - 2.0 * m) * (v - x_min) / (x_max - x_min).max(1e-12);
    let y = |v: f64| h - m - (h - 2.0 * m) * (v - y_min) / (y_max - y_min);
    let colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"];
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{}\" y=\"20\" text-anchor=\"middle\" font-size=\"14\">{title}</text>\n",
        w / 2.0
    );
    let _ = writeln!(
        s,
        "<line x1=\"{m}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>",
        h - m,
        w - m,
        h - m
    );
    let _ = writeln!(
        s,
        "<line x1=\"{m}\" y1=\"{m}\" x2=\"{m}\" y2=\"{}\" stroke=\"black\"/>",
        h - m
    );
    for i in 0..=4 {
        let tx = x_min + (x_max - x_min) * i as f64 / 4.0;
        let ty = y_min + (y_max - y_min) * i as f64 / 4.0;
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
            x(tx),
            h - m + 18.0,
            fmt_tick(tx)
        );
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
            m - 6.0,
            y(ty) + 4.0,
            fmt_tick(ty)
        );
    }
    let _ = writeln!(
        s,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{x_label}</text>",
        w / 2.0,
        h - 15.0
    );
    let _ = writeln!(
        s,
        "<text x=\"15\" y=\"{0}\" transform=\"rotate(-90 15 {0})\" text-anchor=\"middle\">{y_label}</text>",
        h / 2.0
    );
    if let Some((r, label)) = reference {
        let _ = writeln!(
            s,
            "<line x1=\"{m}\" y1=\"{0:.1}\" x2=\"{1}\" y2=\"{0:.1}\" stroke=\"gray\" stroke-dasharray=\"4 4\"/><text x=\"{1}\" y=\"{2:.1}\" text-anchor=\"end\" fill=\"gray\">{label}</text>",
            y(r),
            w - m,
            y(r) - 4.0
        );
    }
    for (i, se) in series.iter().enumerate() {
        let c = colors[i % colors.len()];
        let pts: Vec<String> = se
            .points
            .iter()
            .map(|p| format!("{:.1},{:.1}", x(p.0), y(p.1)))
            .collect();
        let _ = writeln!(
            s,
            "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"2\" points=\"{}\"/>",
            pts.join(" ")
        );
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{}\" fill=\"{c}\">{}</text>",
            w - m - 120.0,
            m + 16.0 * (i as f64 + 1.0),
            se.name
        );
    }
    s.push_str("</svg>\n");
    s
}

fn fmt_tick(v: f64) -> String {
    if v.abs() >= 1000.0 || v == v.trunc() {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}
