//! Charts as SVG and PNG, drawn with `plotters`.
//!
//! Text is set in Noto Sans Regular (the `ttf-noto-sans` crate embeds it),
//! so the PNGs need no system fonts. Axes get plotters' round tick values;
//! a reference line (a target loss, a memory budget) is a dashed series
//! named in the legend, so its label never sits on the curves. Each file
//! is written atomically.

use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::prelude::*;

/// Errors of drawing or writing a chart.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// The drawing backend failed.
    #[error("cannot draw {path}: {reason}")]
    Draw {
        /// The chart file.
        path: String,
        /// The backend's message.
        reason: String,
    },
    /// The file could not be written.
    #[error("cannot write {path}: {error}")]
    Write {
        /// The path.
        path: String,
        /// The I/O error.
        error: std::io::Error,
    },
}

/// One named line.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend label.
    pub name: String,
    /// Points `(x, y)`; non-finite points are left out.
    pub points: Vec<(f64, f64)>,
}

/// A horizontal dashed reference line at `y`, named in the legend.
#[derive(Debug, Clone)]
pub struct Reference {
    /// Its height.
    pub y: f64,
    /// Its legend label.
    pub label: String,
}

/// One bar of a stacked bar chart: a category and its stacked parts.
#[derive(Debug, Clone)]
pub struct Bar {
    /// Category label under the bar.
    pub label: String,
    /// Heights of the stacked parts, in the order of the chart's part names.
    pub parts: Vec<f64>,
}

/// Axis titles and the chart title.
#[derive(Debug, Clone, Copy)]
pub struct Labels<'a> {
    /// Chart title.
    pub title: &'a str,
    /// x-axis title.
    pub x: &'a str,
    /// y-axis title.
    pub y: &'a str,
}

const SIZE: (u32, u32) = (800, 480);
/// Share of the data's height added above it for the legend.
const LEGEND_ROOM: f64 = 0.3;
const COLORS: [RGBColor; 5] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
];

fn register_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // The embedded font is a valid TrueType file; a failure here would
        // only drop text, so it is not worth an error path.
        let _ =
            plotters::style::register_font("sans-serif", FontStyle::Normal, ttf_noto_sans::REGULAR);
    });
}

fn draw_err(path: &Path) -> impl Fn(String) -> PlotError + '_ {
    move |reason| PlotError::Draw {
        path: path.display().to_string(),
        reason,
    }
}

/// A chart that can draw itself on any backend.
trait Chart {
    fn draw<DB: DrawingBackend>(&self, area: DrawingArea<DB, Shift>) -> Result<(), String>;
}

/// Draws `chart` into `<stem>.svg` and `<stem>.png`; returns both paths.
fn render(stem: &Path, chart: &impl Chart) -> Result<Vec<PathBuf>, PlotError> {
    register_font();
    let svg_path = stem.with_extension("svg");
    let mut svg = String::new();
    {
        let area = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        chart.draw(area).map_err(draw_err(&svg_path))?;
    }
    crate::fsutil::write_atomic(&svg_path, svg.as_bytes()).map_err(|error| PlotError::Write {
        path: svg_path.display().to_string(),
        error,
    })?;
    // The PNG is drawn into a temporary file beside its target (the encoder
    // picks the format from the extension), then renamed over it.
    let png_path = stem.with_extension("png");
    let tmp = stem.with_extension(format!("{}.tmp.png", std::process::id()));
    let drawn = (|| {
        let area = BitMapBackend::new(&tmp, SIZE).into_drawing_area();
        chart.draw(area.clone())?;
        area.present().map_err(|e| e.to_string())
    })();
    if let Err(reason) = drawn {
        let _ = std::fs::remove_file(&tmp);
        return Err(draw_err(&png_path)(reason));
    }
    std::fs::rename(&tmp, &png_path).map_err(|error| {
        let _ = std::fs::remove_file(&tmp);
        PlotError::Write {
            path: png_path.display().to_string(),
            error,
        }
    })?;
    Ok(vec![svg_path, png_path])
}

/// The range of `values` padded by 5% (a flat or empty range gets a unit
/// span), for round ticks that clear the data.
fn padded(values: impl Iterator<Item = f64>, floor_at_zero: bool) -> (f64, f64) {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
            (a.min(v), b.max(v))
        });
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    let span = (hi - lo).max(hi.abs() * 1e-3).max(1e-9);
    let lo = if floor_at_zero && lo >= 0.0 {
        0.0
    } else {
        lo - 0.05 * span
    };
    (lo, hi + 0.05 * span)
}

/// A line chart of `series` (and an optional dashed reference line) written
/// as `<stem>.svg` and `<stem>.png`.
pub fn lines(
    stem: &Path,
    labels: Labels<'_>,
    series: &[Series],
    reference: Option<&Reference>,
) -> Result<Vec<PathBuf>, PlotError> {
    let finite = |p: &&(f64, f64)| p.0.is_finite() && p.1.is_finite();
    let xs = series
        .iter()
        .flat_map(|s| s.points.iter().filter(finite).map(|p| p.0));
    let (x_lo, x_hi) = padded(xs, true);
    let ys = series
        .iter()
        .flat_map(|s| s.points.iter().filter(finite).map(|p| p.1))
        .chain(reference.map(|r| r.y));
    let (y_lo, y_hi) = padded(ys, false);
    // Headroom above the data for the legend, so it covers no curve.
    let y_hi = y_hi + LEGEND_ROOM * (y_hi - y_lo);
    let chart = LineChart {
        labels,
        series,
        reference,
        x: (x_lo, x_hi),
        y: (y_lo, y_hi),
    };
    render(stem, &chart)
}

struct LineChart<'a> {
    labels: Labels<'a>,
    series: &'a [Series],
    reference: Option<&'a Reference>,
    x: (f64, f64),
    y: (f64, f64),
}

impl Chart for LineChart<'_> {
    fn draw<DB: DrawingBackend>(&self, area: DrawingArea<DB, Shift>) -> Result<(), String> {
        let (labels, series, reference) = (self.labels, self.series, self.reference);
        let ((x_lo, x_hi), (y_lo, y_hi)) = (self.x, self.y);
        let finite = |p: &&(f64, f64)| p.0.is_finite() && p.1.is_finite();
        area.fill(&WHITE).map_err(|e| e.to_string())?;
        let mut chart = ChartBuilder::on(&area)
            .caption(labels.title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(64)
            .build_cartesian_2d(x_lo..x_hi, y_lo..y_hi)
            .map_err(|e| e.to_string())?;
        // Steps and other counts are labelled as whole numbers ("10", not
        // "10.0").
        let whole_x = series
            .iter()
            .flat_map(|s| s.points.iter().filter(finite))
            .all(|p| p.0.fract() == 0.0);
        // Fractional ticks of a whole-number axis stay unlabelled.
        let whole_label = |v: &f64| {
            if v.fract() == 0.0 {
                format!("{v:.0}")
            } else {
                String::new()
            }
        };
        let mut mesh = chart.configure_mesh();
        mesh.x_desc(labels.x)
            .y_desc(labels.y)
            .label_style(("sans-serif", 13));
        if whole_x {
            mesh.x_label_formatter(&whole_label);
        }
        mesh.draw().map_err(|e| e.to_string())?;
        for (i, s) in series.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            let points = s.points.iter().filter(finite).copied();
            // A series identical to an earlier one is drawn dashed over it,
            // so that neither hides the other.
            let repeats = series[..i].iter().any(|o| o.points == s.points);
            let drawn = if repeats {
                chart.draw_series(DashedLineSeries::new(points, 10, 8, color.stroke_width(2)))
            } else {
                chart.draw_series(LineSeries::new(points, color.stroke_width(2)))
            };
            drawn
                .map_err(|e| e.to_string())?
                .label(s.name.as_str())
                .legend(move |(x, y)| {
                    if repeats {
                        PathElement::new(vec![(x, y), (x + 7, y)], color.stroke_width(2))
                    } else {
                        PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                    }
                });
        }
        if let Some(r) = reference {
            let dashes = dashed(x_lo, x_hi, r.y);
            chart
                .draw_series(
                    dashes
                        .into_iter()
                        .map(|seg| PathElement::new(seg, BLACK.mix(0.6))),
                )
                .map_err(|e| e.to_string())?
                .label(r.label.as_str())
                .legend(|(x, y)| {
                    PathElement::new(vec![(x, y), (x + 6, y), (x + 12, y)], BLACK.mix(0.6))
                });
        }
        draw_legend(&mut chart)
    }
}

/// The legend, top right, over a light background.
fn draw_legend<'a, DB: DrawingBackend + 'a, CT: plotters::coord::CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
) -> Result<(), String> {
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.3))
        .label_font(("sans-serif", 13))
        .draw()
        .map_err(|e| e.to_string())
}

/// Dashes of a horizontal line at `y` from `x0` to `x1` (40 dashes).
fn dashed(x0: f64, x1: f64, y: f64) -> Vec<Vec<(f64, f64)>> {
    let step = (x1 - x0) / 80.0;
    (0..40)
        .map(|i| {
            let a = x0 + step * (2 * i) as f64;
            vec![(a, y), (a + step, y)]
        })
        .collect()
}

/// A stacked bar chart, one bar per [`Bar`] with its parts named by
/// `part_names` in the legend, and an optional dashed reference line,
/// written as `<stem>.svg` and `<stem>.png`.
pub fn stacked_bars(
    stem: &Path,
    labels: Labels<'_>,
    part_names: &[&str],
    bars: &[Bar],
    reference: Option<&Reference>,
) -> Result<Vec<PathBuf>, PlotError> {
    let tops = bars
        .iter()
        .map(|b| b.parts.iter().filter(|v| v.is_finite()).sum::<f64>())
        .chain(reference.map(|r| r.y));
    let (_, y_hi) = padded(tops.chain([0.0]), true);
    let y_hi = y_hi * (1.0 + LEGEND_ROOM);
    let chart = BarChart {
        labels,
        part_names,
        bars,
        reference,
        y_hi,
    };
    render(stem, &chart)
}

struct BarChart<'a> {
    labels: Labels<'a>,
    part_names: &'a [&'a str],
    bars: &'a [Bar],
    reference: Option<&'a Reference>,
    y_hi: f64,
}

impl Chart for BarChart<'_> {
    fn draw<DB: DrawingBackend>(&self, area: DrawingArea<DB, Shift>) -> Result<(), String> {
        let (labels, part_names, bars, reference, y_hi) = (
            self.labels,
            self.part_names,
            self.bars,
            self.reference,
            self.y_hi,
        );
        // Integer ranges are inclusive in plotters: `0..n - 1` is n segments.
        let n = bars.len().max(1);
        area.fill(&WHITE).map_err(|e| e.to_string())?;
        let mut chart = ChartBuilder::on(&area)
            .caption(labels.title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(64)
            .build_cartesian_2d((0..n - 1).into_segmented(), 0.0..y_hi)
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_desc(labels.x)
            .y_desc(labels.y)
            .x_labels(n)
            .x_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) => {
                    bars.get(*i).map_or(String::new(), |b| b.label.clone())
                }
                _ => String::new(),
            })
            .label_style(("sans-serif", 13))
            .draw()
            .map_err(|e| e.to_string())?;
        for (p, name) in part_names.iter().enumerate() {
            let color = COLORS[p % COLORS.len()];
            let rects = bars.iter().enumerate().map(|(i, b)| {
                let below: f64 = b.parts[..p.min(b.parts.len())]
                    .iter()
                    .filter(|v| v.is_finite())
                    .sum();
                let h = b
                    .parts
                    .get(p)
                    .copied()
                    .filter(|v| v.is_finite())
                    .unwrap_or(0.0);
                let mut r = Rectangle::new(
                    [
                        (SegmentValue::Exact(i), below),
                        (SegmentValue::Exact(i + 1), below + h),
                    ],
                    color.mix(0.85).filled(),
                );
                r.set_margin(0, 0, 18, 18);
                r
            });
            chart
                .draw_series(rects)
                .map_err(|e| e.to_string())?
                .label(*name)
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled())
                });
        }
        if let Some(r) = reference {
            chart
                .draw_series(std::iter::once(PathElement::new(
                    vec![(SegmentValue::Exact(0), r.y), (SegmentValue::Last, r.y)],
                    BLACK.mix(0.6).stroke_width(2),
                )))
                .map_err(|e| e.to_string())?
                .label(r.label.as_str())
                .legend(|(x, y)| {
                    PathElement::new(vec![(x, y), (x + 12, y)], BLACK.mix(0.6).stroke_width(2))
                });
        }
        draw_legend(&mut chart)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("lrmoe-plots-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("temp dir");
        d
    }

    const L: Labels<'static> = Labels {
        title: "t",
        x: "x",
        y: "y",
    };

    #[test]
    fn line_charts_write_svg_and_png_with_round_ticks() {
        let d = dir("lines");
        let s = vec![Series {
            name: "full".into(),
            points: vec![(0.0, 3.0), (10.0, 2.5), (20.5, 2.1), (f64::NAN, 1.0)],
        }];
        let r = Reference {
            y: 2.0,
            label: "target 2.000".into(),
        };
        let files = lines(&d.join("curve"), L, &s, Some(&r)).expect("draws");
        let svg = std::fs::read_to_string(&files[0]).expect("svg");
        assert!(svg.contains("target 2.000") && svg.contains("full"));
        // Round tick labels, not 0.00-style ones.
        let texts: Vec<&str> = svg.lines().map(str::trim).collect();
        let ticks: Vec<&str> = texts
            .iter()
            .copied()
            .filter(|t| t.parse::<f64>().is_ok())
            .collect();
        assert!(ticks.contains(&"10.0") && ticks.len() >= 8, "{svg}");
        // Round values: at most one decimal.
        assert!(
            ticks
                .iter()
                .all(|t| t.split('.').nth(1).is_none_or(|d| d.len() <= 1)),
            "{ticks:?}"
        );
        let png = std::fs::read(&files[1]).expect("png");
        assert_eq!(&png[1..4], b"PNG");
        // No temporary files left beside the charts.
        let names: Vec<String> = std::fs::read_dir(&d)
            .expect("dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }

    #[test]
    fn stacked_bars_name_their_parts_and_categories() {
        let d = dir("bars");
        let bars = vec![
            Bar {
                label: "Fixed".into(),
                parts: vec![100.0, 0.0, 400.0],
            },
            Bar {
                label: "LRMoE".into(),
                parts: vec![100.0, 50.0, 200.0],
            },
        ];
        let r = Reference {
            y: 450.0,
            label: "budget 450 MiB".into(),
        };
        let files = stacked_bars(
            &d.join("mem"),
            L,
            &["placement", "replicas", "token buffers"],
            &bars,
            Some(&r),
        )
        .expect("draws");
        let svg = std::fs::read_to_string(&files[0]).expect("svg");
        for needle in [
            "Fixed",
            "LRMoE",
            "placement",
            "token buffers",
            "budget 450 MiB",
        ] {
            assert!(svg.contains(needle), "{needle}");
        }
    }

    #[test]
    fn step_axes_are_whole_and_identical_series_both_show() {
        let d = dir("steps");
        let a = Series {
            name: "full".into(),
            points: vec![(0.0, 3.0), (10.0, 2.5), (20.0, 2.1)],
        };
        let b = Series {
            name: "lrmoe".into(),
            ..a.clone()
        };
        let files = lines(&d.join("c"), L, &[a, b], None).expect("draws");
        let svg = std::fs::read_to_string(&files[0]).expect("svg");
        let texts: Vec<&str> = svg.lines().map(str::trim).collect();
        assert!(texts.contains(&"10") && !texts.contains(&"10.0"), "{svg}");
        // The repeated series is drawn in dashes: more than one path of its
        // colour.
        let second = "stroke=\"#D62728\"";
        assert!(svg.matches(second).count() > 3, "{svg}");
    }

    #[test]
    fn empty_and_flat_data_still_draw() {
        let d = dir("empty");
        lines(&d.join("a"), L, &[], None).expect("empty chart");
        let flat = vec![Series {
            name: "x".into(),
            points: vec![(0.0, 1.0)],
        }];
        lines(&d.join("b"), L, &flat, None).expect("one point");
    }
}
