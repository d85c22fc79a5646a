//! The comparison's two charts, as SVG and PNG: latency CDF of the 64-byte
//! echo and goodput against payload size.

use std::error::Error;
use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

/// One contender's line.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend text.
    pub name: String,
    /// Points in chart units.
    pub points: Vec<(f64, f64)>,
}

/// A chart: title, axis names, log-scale x, lines.
#[derive(Debug, Clone)]
pub struct Chart {
    /// Caption.
    pub title: String,
    /// X axis description.
    pub x_label: String,
    /// Y axis description.
    pub y_label: String,
    /// The lines.
    pub series: Vec<Series>,
}

const SIZE: (u32, u32) = (960, 600);
const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// Makes the DejaVu Sans font available to the PNG backend (SVG needs no
/// font file: its text is drawn by the viewer). Returns why not, if not.
pub fn load_font() -> Result<(), String> {
    let bytes = std::fs::read(FONT).map_err(|error| format!("{FONT}: {error}"))?;
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| format!("{FONT}: not a usable font"))
}

fn draw<DB>(root: DrawingArea<DB, Shift>, chart: &Chart) -> Result<(), Box<dyn Error>>
where
    DB: DrawingBackend,
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let points = chart.series.iter().flat_map(|s| s.points.iter());
    let (mut x_min, mut x_max, mut y_max) = (f64::MAX, f64::MIN, 0f64);
    for (x, y) in points {
        x_min = x_min.min(*x);
        x_max = x_max.max(*x);
        y_max = y_max.max(*y);
    }
    if x_min >= x_max {
        x_max = x_min * 10.0;
    }
    let mut plot = ChartBuilder::on(&root)
        .caption(&chart.title, ("sans-serif", 22))
        .margin(14)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d((x_min * 0.8..x_max * 1.25).log_scale(), 0f64..y_max * 1.08)?;
    plot.configure_mesh()
        .x_desc(chart.x_label.as_str())
        .y_desc(chart.y_label.as_str())
        .label_style(("sans-serif", 14))
        .draw()?;
    for (index, series) in chart.series.iter().enumerate() {
        let color = Palette99::pick(index).to_rgba();
        plot.draw_series(LineSeries::new(
            series.points.iter().copied(),
            ShapeStyle::from(color).stroke_width(2),
        ))?
        .label(series.name.as_str())
        .legend(move |(x, y)| {
            PathElement::new(
                vec![(x, y), (x + 22, y)],
                ShapeStyle::from(color).stroke_width(2),
            )
        });
    }
    plot.configure_series_labels()
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()?;
    root.present()?;
    Ok(())
}

/// Writes `<stem>.svg`, and `<stem>.png` when `png` (a font is loaded).
pub fn write(chart: &Chart, stem: &Path, png: bool) -> Result<Vec<String>, Box<dyn Error>> {
    let svg = stem.with_extension("svg");
    draw(SVGBackend::new(&svg, SIZE).into_drawing_area(), chart)?;
    let mut written = vec![svg.display().to_string()];
    if png {
        let png = stem.with_extension("png");
        draw(BitMapBackend::new(&png, SIZE).into_drawing_area(), chart)?;
        written.push(png.display().to_string());
    }
    Ok(written)
}
