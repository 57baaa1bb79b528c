//! SVG charts (plotters): each request as a dot, start time against latency, green for
//! 200, rose for anything else; optional dashed line at the budget.

use std::path::Path;

use plotters::prelude::*;

use crate::record::Record;

/// Draws `records` to an SVG file at `path`, written whole or not at all.
///
/// # Errors
/// When the file cannot be written.
pub fn latency_chart(
    path: &Path,
    title: &str,
    records: &[Record],
    budget_s: Option<f64>,
) -> Result<(), String> {
    let mut svg = String::new();
    draw(
        SVGBackend::with_string(&mut svg, (900, 480)).into_drawing_area(),
        title,
        records,
        budget_s,
    )?;
    crate::record::write_file_atomically(path, |w| w.write_all(svg.as_bytes()))
}

fn draw(
    root: DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    title: &str,
    records: &[Record],
    budget_s: Option<f64>,
) -> Result<(), String> {
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let max_x = records
        .iter()
        .map(|r| r.start.as_secs_f64())
        .fold(1.0_f64, f64::max)
        * 1.05;
    let max_y = records
        .iter()
        .map(|r| r.latency().as_secs_f64())
        .fold(budget_s.unwrap_or(0.5), f64::max)
        * 1.1;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..max_x, 0.0..max_y)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("request start (s from the start of the run)")
        .y_desc("seconds to answer")
        .draw()
        .map_err(|e| e.to_string())?;
    let ok = RGBColor(46, 139, 87);
    let err = RGBColor(205, 92, 120);
    chart
        .draw_series(records.iter().filter(|r| r.status == 200).map(|r| {
            Circle::new(
                (r.start.as_secs_f64(), r.latency().as_secs_f64()),
                3,
                ok.filled(),
            )
        }))
        .map_err(|e| e.to_string())?
        .label("200")
        .legend(move |(x, y)| Circle::new((x, y), 4, ok.filled()));
    chart
        .draw_series(records.iter().filter(|r| r.status != 200).map(|r| {
            Circle::new(
                (r.start.as_secs_f64(), r.latency().as_secs_f64()),
                3,
                err.filled(),
            )
        }))
        .map_err(|e| e.to_string())?
        .label("other")
        .legend(move |(x, y)| Circle::new((x, y), 4, err.filled()));
    if let Some(b) = budget_s {
        chart
            .draw_series(DashedLineSeries::new(
                vec![(0.0, b), (max_x, b)],
                6,
                4,
                BLACK.stroke_width(1),
            ))
            .map_err(|e| e.to_string())?
            .label("parking budget")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], BLACK));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}
