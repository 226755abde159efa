//! Draws `scripts/bench.sh`'s comparison table as an SVG: one bar per measured row, its ratio to
//! the baseline divided by its target (1 = target met), with the range of the rounds.
//!
//! ```text
//! scripts/bench.sh            # writes docs/bench.svg through this example
//! printf '%s\n' "| row | 1 | base | 1 | 0.91 (0.90–0.93) | ≥ 0.90 |" | cargo run --example bench_chart -- out.svg
//! ```

use std::io::Read;

use plotters::prelude::*;

/// One row of the table: what, the ratio's median and range, and its target.
struct Row {
    label: String,
    ratio: f64,
    low: f64,
    high: f64,
    target: f64,
}

fn number(s: &str) -> Option<f64> {
    s.trim()
        .trim_start_matches('≥')
        .trim()
        .replace(',', "")
        .parse()
        .ok()
}

/// `| label | value | baseline | value | 0.91 (0.90–0.93) | ≥ 0.90 |`; rows without a numeric
/// target (information only) are left out.
fn parse(line: &str) -> Option<Row> {
    let cells: Vec<&str> = line.trim().trim_matches('|').split('|').collect();
    let (label, baseline, ratio, target) =
        (cells.first()?, cells.get(2)?, cells.get(4)?, cells.get(5)?);
    let (median, range) = ratio.split_once('(').unwrap_or((ratio, ""));
    let ratio = number(median)?;
    let (low, high) = range
        .trim_end_matches(')')
        .split_once('–')
        .and_then(|(a, b)| Some((number(a)?, number(b)?)))
        .unwrap_or((ratio, ratio));
    Some(Row {
        label: format!("{} vs {}", label.trim(), baseline.trim()),
        ratio,
        low,
        high,
        target: number(target)?,
    })
}

fn main() -> Result<(), String> {
    let path = std::env::args()
        .nth(1)
        .ok_or("usage: bench_chart OUT.svg < table rows")?;
    let mut input = String::new();
    std::io::stdin()
        .read_to_string(&mut input)
        .map_err(|e| e.to_string())?;
    let rows: Vec<Row> = input.lines().filter_map(parse).collect();
    if rows.is_empty() {
        return Err("no table rows with a numeric target on stdin".into());
    }
    let n = rows.len();
    let right = rows
        .iter()
        .map(|r| r.high / r.target)
        .fold(1.2, f64::max)
        .min(3.0);
    let root = SVGBackend::new(&path, (1000, 90 + 60 * n as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "scripts/bench.sh: each ratio to its baseline ÷ its target (1 = target met)",
            ("sans-serif", 18),
        )
        .margin(14)
        .x_label_area_size(34)
        .build_cartesian_2d(0.0..right, 0.0..n as f64)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .disable_y_axis()
        .x_desc("ratio ÷ target")
        .draw()
        .map_err(|e| e.to_string())?;
    for (i, r) in rows.iter().enumerate() {
        let y = (n - 1 - i) as f64;
        let met = r.ratio >= r.target;
        let colour = if met {
            GREEN.mix(0.6)
        } else {
            RGBColor(230, 140, 30).mix(0.8)
        };
        let value = (r.ratio / r.target).min(right);
        chart
            .draw_series([Rectangle::new(
                [(0.0, y + 0.2), (value, y + 0.8)],
                colour.filled(),
            )])
            .map_err(|e| e.to_string())?;
        chart
            .draw_series([PathElement::new(
                [
                    ((r.low / r.target).min(right), y + 0.5),
                    ((r.high / r.target).min(right), y + 0.5),
                ],
                BLACK.stroke_width(2),
            )])
            .map_err(|e| e.to_string())?;
        chart
            .draw_series([Text::new(
                format!("{} — {:.2} (target {})", r.label, r.ratio, r.target),
                (0.02, y + 0.62),
                ("sans-serif", 13),
            )])
            .map_err(|e| e.to_string())?;
    }
    chart
        .draw_series([PathElement::new(
            [(1.0, 0.0), (1.0, n as f64)],
            RED.stroke_width(2),
        )])
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())?;
    eprintln!("wrote {path}");
    Ok(())
}
