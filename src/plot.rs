//! Training curves: a [`MetricsTable`], read from a metrics CSV (`observe::CsvMetrics`,
//! `lockstep train --metrics-out`) or taken from a [`TrainReport`] in memory, drawn as a
//! PNG with two panels, loss and accuracy, train and the held-out set (named for what it
//! is: test or validation). [`png`] returns the image's bytes (a notebook shows them
//! inline); [`plot_metrics_csv`] and [`plot_table`] write them to a file.
//!
//! Owns: reading the CSV back (with errors that name the line), the layout of the figure,
//! its encoding, and writing the file atomically (`fsutil::replace_with`: a reader never
//! sees half an image).
//!
//! Text needs a font, and this crate must draw the same on every machine without asking
//! the system for one: DejaVu Sans is embedded (`assets/fonts`, Bitstream Vera licence)
//! and handed to plotters' `ab_glyph` renderer. Leaves the CSV's format to `observe`.

use std::error::Error as StdError;
use std::path::Path;
use std::sync::OnceLock;

use plotters::prelude::*;
use plotters::style::FontStyle;

use crate::error::{Error, Result};
use crate::train::{HeldOut, TrainReport};

/// What the horizontal axis counts.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum XAxis {
    /// Steps: train loss and accuracy of every step, epoch means and validation at the
    /// step that ends each epoch.
    Step,
    /// Epochs: one point per epoch, train and validation.
    Epoch,
}

/// One `step` row: steps done, loss and accuracy of that step's global batch.
#[derive(Clone, Debug, PartialEq)]
pub struct StepRow {
    pub step: f64,
    pub loss: f64,
    pub accuracy: f64,
}

/// One `epoch` row: steps done by its end, epoch (1-based), train and validation metrics.
#[derive(Clone, Debug, PartialEq)]
pub struct EpochRow {
    pub step: f64,
    pub epoch: f64,
    pub loss: f64,
    pub accuracy: f64,
    pub val_loss: Option<f64>,
    pub val_accuracy: Option<f64>,
}

/// The rows of a metrics CSV, or of a run's report.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MetricsTable {
    pub steps: Vec<StepRow>,
    pub epochs: Vec<EpochRow>,
    /// What the epochs' held-out cells measured, which the legend names; None when no
    /// epoch has any.
    pub held_out: Option<HeldOut>,
}

/// A run's curves without a file: each step's loss (a report keeps no per-step accuracy,
/// so that curve has no points) and each epoch's train and held-out metrics, at the step
/// that ended it. Steps are numbered as in the CSV (steps done), resumed ones counted.
impl From<&TrainReport> for MetricsTable {
    fn from(r: &TrainReport) -> MetricsTable {
        let before = r.steps.saturating_sub(r.losses.len() as u64);
        let steps = r
            .losses
            .iter()
            .enumerate()
            .map(|(i, &loss)| StepRow { step: (before + i as u64 + 1) as f64, loss, accuracy: f64::NAN })
            .collect();
        let epochs = r
            .epochs
            .iter()
            .map(|e| EpochRow {
                step: e.step_at_end as f64,
                epoch: (e.epoch + 1) as f64,
                loss: e.train.mean_loss(),
                accuracy: e.train.accuracy(),
                val_loss: e.held_out().map(|m| m.mean_loss()),
                val_accuracy: e.held_out().map(|m| m.accuracy()),
            })
            .collect();
        let held_out = r.epochs.iter().find_map(|e| match (e.val, e.test) {
            (Some(_), _) => Some(HeldOut::Validation),
            (None, Some(_)) => Some(HeldOut::Test),
            (None, None) => None,
        });
        MetricsTable { steps, epochs, held_out }
    }
}

/// The columns `plot` reads (others are ignored, in any order). The first five must be
/// there; the held-out ones may not be (`test_*` came with the test/validation naming, so
/// older files have only `val_*`). An epoch's held-out curve is its `val_*` cells, else
/// its `test_*` ones; the table's `held_out` says which the file filled.
const COLUMNS: [&str; 9] =
    ["kind", "step", "epoch", "loss", "accuracy", "val_loss", "val_accuracy", "test_loss", "test_accuracy"];
const REQUIRED: usize = 5;

/// Memory per byte of a metrics CSV while it is read: the text, and its rows as numbers
/// (a step row of three f64, 24 bytes, comes from a line of at least 12 bytes: two more).
const BYTES_PER_CSV_BYTE: u64 = 1 + 2;

/// Reads a metrics CSV: a regular file (never a FIFO or a device, which have no end to
/// read to), whose text and rows fit in memory. Errors name the file and, for a malformed
/// line, its number (1-based, the header being line 1).
pub fn read_metrics_csv(path: &Path) -> Result<MetricsTable> {
    let bytes = crate::fsutil::read_whole(path, BYTES_PER_CSV_BYTE, "its text and its rows as numbers")?;
    let text = String::from_utf8(bytes).map_err(|e| {
        Error::format(path, format!("byte {} is not UTF-8 text: not a metrics CSV", e.utf8_error().valid_up_to()))
    })?;
    let mut lines = text.lines().enumerate();
    let header = match lines.next() {
        Some((_, h)) => h,
        None => return Err(Error::format(path, "empty file: expected the header of a lockstep metrics CSV")),
    };
    let names: Vec<&str> = header.split(',').map(str::trim).collect();
    let mut col = [None; COLUMNS.len()];
    for (i, c) in COLUMNS.iter().enumerate() {
        col[i] = names.iter().position(|n| n == c);
        if col[i].is_none() && i < REQUIRED {
            return Err(Error::format(
                path,
                format!("line 1: header has no '{c}' column (expected '{}')", crate::observe::CSV_HEADER),
            ));
        }
    }
    let mut table = MetricsTable::default();
    let (mut val_cells, mut test_cells) = (false, false);
    for (i, line) in lines {
        let n = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        let cells: Vec<&str> = line.split(',').map(str::trim).collect();
        if cells.len() != names.len() {
            return Err(Error::format(
                path,
                format!("line {n}: {} cells, the header has {}", cells.len(), names.len()),
            ));
        }
        let cell = |k: usize| -> Result<Option<f64>> {
            let Some(at) = col[k] else { return Ok(None) };
            let c = cells[at];
            if c.is_empty() {
                return Ok(None);
            }
            c.parse::<f64>()
                .map(Some)
                .map_err(|_| Error::format(path, format!("line {n}: {} '{c}' is not a number", COLUMNS[k])))
        };
        let need = |k: usize| -> Result<f64> {
            cell(k)?.ok_or_else(|| Error::format(path, format!("line {n}: {} is empty", COLUMNS[k])))
        };
        match cells[col[0].expect("a required column")] {
            "step" => table.steps.push(StepRow { step: need(1)?, loss: need(3)?, accuracy: need(4)? }),
            "epoch" => {
                let (val, test) = (cell(5)?, cell(7)?);
                val_cells |= val.is_some();
                test_cells |= test.is_some();
                table.epochs.push(EpochRow {
                    step: need(1)?,
                    epoch: need(2)?,
                    loss: need(3)?,
                    accuracy: need(4)?,
                    val_loss: val.or(test),
                    val_accuracy: cell(6)?.or(cell(8)?),
                })
            }
            // A held-out evaluation after the epochs: one point, not a curve.
            "test" | "val" => {}
            other => {
                return Err(Error::format(
                    path,
                    format!("line {n}: kind '{other}' is none of 'step', 'epoch', 'test', 'val'"),
                ))
            }
        }
    }
    if table.steps.is_empty() && table.epochs.is_empty() {
        return Err(Error::format(path, "no data rows after the header"));
    }
    table.held_out = match (val_cells, test_cells) {
        (true, _) => Some(HeldOut::Validation),
        (false, true) => Some(HeldOut::Test),
        (false, false) => None,
    };
    Ok(table)
}

/// Reads `csv` and writes training curves to `out` as a PNG (whatever its extension),
/// atomically. Errors: a missing or malformed CSV (naming the line), no data rows, no
/// epoch rows with [`XAxis::Epoch`], an output that cannot be written.
pub fn plot_metrics_csv(csv: &Path, out: &Path, x: XAxis) -> Result<()> {
    // The image would replace the metrics it is drawn from (through a link as well).
    if crate::fsutil::same_file(csv, out) {
        return Err(Error::format(
            out,
            format!("is the metrics CSV being plotted ({}): give the PNG a file of its own", csv.display()),
        ));
    }
    let table = read_metrics_csv(csv)?;
    if x == XAxis::Epoch && table.epochs.is_empty() {
        return Err(Error::format(csv, "no epoch rows to plot per epoch (the run ended inside its first epoch?)"));
    }
    let title = format!("Training curves: {}", csv.file_name().map_or(String::new(), |n| n.to_string_lossy().into()));
    plot_table(&table, &title, out, x)
}

/// Draws `table` to `out` (PNG, atomically).
pub fn plot_table(table: &MetricsTable, title: &str, out: &Path, x: XAxis) -> Result<()> {
    if out.is_dir() {
        return Err(Error::format(out, "is a directory, not a file path"));
    }
    let bytes = png(table, title, x)?;
    crate::fsutil::replace_with(out, |tmp| std::fs::write(tmp, &bytes).map_err(|e| Error::io(out, e)))
}

/// The figure of `table` as PNG bytes, drawn in memory: what a notebook shows inline
/// (`lockstep::plot::png(&(&report).into(), "…", XAxis::Step)`).
pub fn png(table: &MetricsTable, title: &str, x: XAxis) -> Result<Vec<u8>> {
    use plotters::prelude::IntoDrawingArea as _;
    register_font()?;
    let failed = |e: Box<dyn StdError>| Error::config("plot", format!("cannot draw the figure: {e}"));
    let mut rgb = vec![0u8; WIDTH as usize * HEIGHT as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, (WIDTH, HEIGHT)).into_drawing_area();
        draw(table, title, root, x).map_err(failed)?;
    }
    let mut out = Vec::new();
    image::ImageEncoder::write_image(
        image::codecs::png::PngEncoder::new(&mut out),
        &rgb,
        WIDTH,
        HEIGHT,
        image::ColorType::Rgb8,
    )
    .map_err(|e| failed(Box::new(e)))?;
    Ok(out)
}

/// The embedded font, registered once as "sans-serif".
fn register_font() -> Result<()> {
    static FONT: OnceLock<bool> = OnceLock::new();
    let ok = *FONT.get_or_init(|| {
        let bytes: &'static [u8] = include_bytes!("../assets/fonts/DejaVuSans.ttf");
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok()
    });
    if ok {
        Ok(())
    } else {
        Err(Error::format("assets/fonts/DejaVuSans.ttf", "the embedded font cannot be read"))
    }
}

const WIDTH: u32 = 1400;
const HEIGHT: u32 = 560;
/// matplotlib's first two colours, so the figure reads like the usual ones.
const TRAIN: RGBColor = RGBColor(31, 119, 180);
const VAL: RGBColor = RGBColor(255, 127, 14);

/// One curve of a panel.
struct Curve {
    label: &'static str,
    points: Vec<(f64, f64)>,
    style: ShapeStyle,
    markers: bool,
}

fn finite(points: impl IntoIterator<Item = (f64, f64)>) -> Vec<(f64, f64)> {
    points.into_iter().filter(|(x, y)| x.is_finite() && y.is_finite()).collect()
}

type DrawResult = std::result::Result<(), Box<dyn StdError>>;

fn draw(
    table: &MetricsTable,
    title: &str,
    root: DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    x: XAxis,
) -> DrawResult {
    let epoch_x = |e: &EpochRow| if x == XAxis::Step { e.step } else { e.epoch };
    let mut loss = Vec::new();
    let mut acc = Vec::new();
    if x == XAxis::Step && !table.steps.is_empty() {
        let thin = TRAIN.mix(0.35).stroke_width(1);
        loss.push(Curve {
            label: "train (each step)",
            points: finite(table.steps.iter().map(|s| (s.step, s.loss))),
            style: thin,
            markers: false,
        });
        acc.push(Curve {
            label: "train (each step)",
            points: finite(table.steps.iter().map(|s| (s.step, s.accuracy))),
            style: thin,
            markers: false,
        });
    }
    let train_label = if x == XAxis::Step { "train (epoch mean)" } else { "train" };
    let bold = |c: RGBColor| c.stroke_width(2);
    loss.push(Curve {
        label: train_label,
        points: finite(table.epochs.iter().map(|e| (epoch_x(e), e.loss))),
        style: bold(TRAIN),
        markers: true,
    });
    acc.push(Curve {
        label: train_label,
        points: finite(table.epochs.iter().map(|e| (epoch_x(e), e.accuracy))),
        style: bold(TRAIN),
        markers: true,
    });
    let held_out = table.held_out.map_or("held out", HeldOut::name);
    loss.push(Curve {
        label: held_out,
        points: finite(table.epochs.iter().filter_map(|e| Some((epoch_x(e), e.val_loss?)))),
        style: bold(VAL),
        markers: true,
    });
    acc.push(Curve {
        label: held_out,
        points: finite(table.epochs.iter().filter_map(|e| Some((epoch_x(e), e.val_accuracy?)))),
        style: bold(VAL),
        markers: true,
    });

    let all = || loss.iter().chain(&acc).flat_map(|c| c.points.iter().map(|p| p.0));
    let (x_lo, x_hi) = match x {
        XAxis::Step => (0.0, all().fold(1.0f64, f64::max)),
        XAxis::Epoch => (all().fold(f64::INFINITY, f64::min).min(1.0) - 0.5, all().fold(1.0f64, f64::max) + 0.5),
    };
    let x_desc = if x == XAxis::Step { "step" } else { "epoch" };

    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 28))?;
    let panels = root.split_evenly((1, 2));

    let loss_hi = loss.iter().flat_map(|c| c.points.iter().map(|p| p.1)).fold(0.0f64, f64::max);
    let loss_hi = if loss_hi > 0.0 { loss_hi * 1.05 } else { 1.0 };
    panel(
        &panels[0],
        "Loss",
        x_desc,
        "mean cross-entropy",
        (x_lo, x_hi),
        (0.0, loss_hi),
        &loss,
        SeriesLabelPosition::UpperRight,
    )?;

    let acc_lo = acc.iter().flat_map(|c| c.points.iter().map(|p| p.1)).fold(1.0f64, f64::min);
    // Room below the lowest point, on a 0.05 grid, so that 0.95 vs 0.99 stays visible.
    let acc_lo = ((acc_lo - 0.02).max(0.0) / 0.05).floor() * 0.05;
    panel(
        &panels[1],
        "Accuracy",
        x_desc,
        "fraction correct",
        (x_lo, x_hi),
        (acc_lo, 1.005),
        &acc,
        SeriesLabelPosition::LowerRight,
    )?;
    root.present()?;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn panel(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    caption: &str,
    x_desc: &str,
    y_desc: &str,
    (x_lo, x_hi): (f64, f64),
    (y_lo, y_hi): (f64, f64),
    curves: &[Curve],
    legend_at: SeriesLabelPosition,
) -> DrawResult {
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 22))
        .margin(18)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d(x_lo..x_hi, y_lo..y_hi)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .light_line_style(RGBColor(235, 235, 235))
        .y_label_formatter(&|v| format!("{v:.2}"))
        .x_label_formatter(&|v| if (v - v.round()).abs() < 1e-9 { format!("{v:.0}") } else { format!("{v:.1}") })
        .draw()?;
    for c in curves.iter().filter(|c| !c.points.is_empty()) {
        let style = c.style;
        chart
            .draw_series(LineSeries::new(c.points.iter().copied(), style))?
            .label(c.label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], style));
        if c.markers {
            chart.draw_series(c.points.iter().map(|&p| Circle::new(p, 3, style.color.filled())))?;
        }
    }
    chart
        .configure_series_labels()
        .position(legend_at)
        .label_font(("sans-serif", 15))
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(160, 160, 160))
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("lockstep-plot-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    const CSV: &str = "kind,step,epoch,loss,accuracy,val_loss,val_accuracy,samples_per_sec\n\
        step,1,1,2.3,0.1,,,1000\n\
        step,2,1,1.5,0.5,,,1000\n\
        epoch,2,1,1.9,0.3,1.2,0.6,1000\n\
        step,3,2,0.9,0.7,,,1000\n\
        step,4,2,0.5,0.9,,,1000\n\
        epoch,4,2,0.7,0.8,0.4,0.88,1000\n";

    #[test]
    fn reads_step_and_epoch_rows() {
        let dir = scratch("read");
        let p = dir.join("m.csv");
        std::fs::write(&p, CSV).unwrap();
        let t = read_metrics_csv(&p).unwrap();
        assert_eq!(t.steps.len(), 4);
        assert_eq!(t.steps[3], StepRow { step: 4.0, loss: 0.5, accuracy: 0.9 });
        assert_eq!(
            t.epochs[1],
            EpochRow { step: 4.0, epoch: 2.0, loss: 0.7, accuracy: 0.8, val_loss: Some(0.4), val_accuracy: Some(0.88) }
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn reads_the_test_and_validation_columns_and_skips_a_final_test_row() {
        // The current header: the held-out cells are test_* for the test split, and a
        // `test` row follows the epochs of a run validated on a split of its training data.
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.csv");
        let text = format!(
            "{}\nstep,1,1,2.3,0.1,,,,,,1000\nepoch,1,1,2.3,0.1,,,1.2,0.6,1,1000\nepoch,2,2,1.1,0.5,0.9,0.7,,,1,1000\ntest,2,,,,,,0.8,0.75,,\n",
            crate::observe::CSV_HEADER
        );
        std::fs::write(&p, text).unwrap();
        let t = read_metrics_csv(&p).unwrap();
        assert_eq!(t.steps.len(), 1);
        assert_eq!((t.epochs[0].val_loss, t.epochs[0].val_accuracy), (Some(1.2), Some(0.6)));
        assert_eq!((t.epochs[1].val_loss, t.epochs[1].val_accuracy), (Some(0.9), Some(0.7)));
        assert_eq!(t.epochs.len(), 2);
        assert_eq!(t.held_out, Some(HeldOut::Validation));
        // A run measured on its test split: the legend says "test", not "validation".
        let text = format!("{}\nepoch,1,1,2.3,0.1,,,1.2,0.6,1,1000\n", crate::observe::CSV_HEADER);
        std::fs::write(&p, text).unwrap();
        assert_eq!(read_metrics_csv(&p).unwrap().held_out, Some(HeldOut::Test));
    }

    /// A report's curves in memory: every step's loss numbered as the CSV numbers them,
    /// each epoch at the step that ended it, the held-out set named, and PNG bytes of the
    /// figure's size with no file written.
    #[test]
    fn a_reports_curves_are_a_png_in_memory() {
        use crate::train::{train_data_parallel, TrainConfig};
        let splits = crate::data::toy::toy_enlarged(40, 3).unwrap();
        let model = crate::models::toy_mlp(2, 2).unwrap();
        let config = TrainConfig { epochs: 3, batch_size: 16, ..TrainConfig::default() };
        let devices = crate::devices::Devices::cpu(2, 1).unwrap();
        let report = train_data_parallel(&model, &splits.train, splits.test.as_ref(), &devices, &config).unwrap();
        let table = MetricsTable::from(&report);
        assert_eq!(table.steps.len() as u64, report.steps);
        assert_eq!(table.steps[0].step, 1.0);
        assert_eq!(table.steps.iter().map(|s| s.loss).collect::<Vec<_>>(), report.losses);
        let per_epoch = report.epochs[0].steps as f64;
        let ends: Vec<f64> = table.epochs.iter().map(|e| e.step).collect();
        assert_eq!(ends, [per_epoch, 2.0 * per_epoch, 3.0 * per_epoch]);
        assert_eq!(table.epochs[2].val_loss, Some(report.epochs[2].test.unwrap().mean_loss()));
        assert_eq!(table.held_out, Some(HeldOut::Test));
        let bytes = png(&table, "toy", XAxis::Step).unwrap();
        let image = image::load_from_memory_with_format(&bytes, image::ImageFormat::Png).unwrap();
        assert_eq!((image.width(), image.height()), (WIDTH, HEIGHT));
        // Not blank: the curves and the text drew something other than white.
        assert!(image.to_rgb8().pixels().any(|p| p.0 != [255, 255, 255]));
    }

    #[test]
    fn malformed_lines_are_named() {
        let dir = scratch("bad");
        let p = dir.join("m.csv");
        let cases = [
            (format!("{CSV}step,5,2,zero,0.9,,,1\n"), "line 8: loss 'zero' is not a number"),
            (CSV.replace("step,3,2,0.9,0.7,,,1000", "step,3,2"), "line 5: 3 cells, the header has 8"),
            (CSV.replace("epoch,2,1", "epoc,2,1"), "line 4: kind 'epoc'"),
            ("kind,step\n".to_string(), "line 1: header has no 'epoch' column"),
            (crate::observe::CSV_HEADER.to_string() + "\n", "no data rows"),
            (String::new(), "empty file"),
        ];
        for (text, needle) in cases {
            std::fs::write(&p, text).unwrap();
            let e = read_metrics_csv(&p).unwrap_err().to_string();
            assert!(e.contains(needle) && e.contains("m.csv"), "{e} (expected '{needle}')");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_csv_is_never_its_own_png_and_only_a_regular_file_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.csv");
        std::fs::write(&p, CSV).unwrap();
        let (soft, hard) = (dir.path().join("soft.png"), dir.path().join("hard.png"));
        std::os::unix::fs::symlink(&p, &soft).unwrap();
        std::fs::hard_link(&p, &hard).unwrap();
        for out in [&p, &soft, &hard] {
            let e = plot_metrics_csv(&p, out, XAxis::Step).unwrap_err().to_string();
            assert_eq!(
                e,
                format!(
                    "{}: is the metrics CSV being plotted ({}): give the PNG a file of its own",
                    out.display(),
                    p.display()
                )
            );
        }
        assert_eq!(std::fs::read_to_string(&p).unwrap(), CSV, "the metrics are untouched");
        // /dev/zero has no end and a FIFO with no writer would block: both refused unread.
        let e = read_metrics_csv(Path::new("/dev/zero")).unwrap_err().to_string();
        assert_eq!(e, "/dev/zero: is a device, not a regular file: lockstep reads only regular files whole");
        let fifo = dir.path().join("pipe");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        let e = read_metrics_csv(&fifo).unwrap_err().to_string();
        assert!(e.ends_with("pipe: is a FIFO, not a regular file: lockstep reads only regular files whole"), "{e}");
        // Bytes that are not text are named by their place.
        std::fs::write(&p, b"kind,step\n\xff").unwrap();
        let e = read_metrics_csv(&p).unwrap_err().to_string();
        assert!(e.ends_with("m.csv: byte 10 is not UTF-8 text: not a metrics CSV"), "{e}");
    }

    #[test]
    fn writes_a_png_and_leaves_no_temporary_file() {
        let dir = scratch("png");
        let p = dir.join("m.csv");
        std::fs::write(&p, CSV).unwrap();
        for (x, name) in [(XAxis::Step, "s.png"), (XAxis::Epoch, "e.png")] {
            let out = dir.join(name);
            plot_metrics_csv(&p, &out, x).unwrap();
            let png = std::fs::read(&out).unwrap();
            // The PNG signature (RFC 2083, 3.1).
            assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        }
        let mut names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        names.sort();
        assert_eq!(names, ["e.png", "m.csv", "s.png"]);
        let e = plot_metrics_csv(&p, &dir.join("missing/c.png"), XAxis::Step).unwrap_err().to_string();
        assert!(e.contains("missing/c.png"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
