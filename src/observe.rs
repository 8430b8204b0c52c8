//! Observers of a training run: what a user sees and keeps while `train_data_parallel_with`
//! runs. [`Progress`] draws a bar on a terminal, or, where there is none (a notebook, a log
//! file, a pipe), prints a line every few seconds inside an epoch and one per epoch (the
//! text format of the CLI lives here and nowhere else); [`JsonLines`] writes one JSON object per
//! step and per epoch; [`CsvMetrics`] writes the metrics file that `lockstep plot` reads;
//! [`Fanout`] runs several of them together.
//!
//! Every observer runs on the coordinator thread (see `train::Observer`), so none of them
//! locks anything. Observers cannot fail a run: a write error is kept and handed back by
//! `finish`, so that a full disk loses the metrics, not the trained weights.
//!
//! Numbering in the files: `step` is the number of steps done once the row's step is
//! (1-based: the first step is 1, and an epoch row carries the steps done by its end);
//! `epoch` is 1-based, as in the text lines ("epoch 1/15"). Numbers that are not finite
//! (a NaN loss under `--allow-nonfinite`) are `null` in JSON, `NaN`/`inf` in the CSV.
//!
//! Left to others: computing the metrics (`train`), reading the CSV back and drawing it
//! (`plot`), choosing observers from flags (`main.rs`).

use std::fmt::Write as _;
use std::fs::File;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{json, Value};

use crate::error::{Error, Result};
use crate::ops::cross_entropy::Metrics;
use crate::train::{EpochReport, EvaluationReport, Observer, StepEvent};

/// A number for JSON: `null` when not finite (JSON has no NaN or infinity).
fn number(x: f64) -> Value {
    if x.is_finite() {
        json!(x)
    } else {
        Value::Null
    }
}

/// Milliseconds from whole nanoseconds (one rounding, so 50 ns prints as 5e-5).
fn millis(d: Duration) -> f64 {
    d.as_nanos() as f64 / 1e6
}

/// Samples per second of one step, from its wall time.
fn step_rate(e: &StepEvent<'_>) -> f64 {
    e.report.metrics.count as f64 / e.report.wall.as_secs_f64().max(1e-12)
}

// ---------------------------------------------------------------------------------------
// Text lines

/// The epoch line of the CLI (`EpochReport::line`): `held_out` names what the per-epoch
/// evaluation ran on, "test" or "validation".
pub fn epoch_line(e: &EpochReport, held_out: &str) -> String {
    e.line(held_out)
}

/// The lesson's lines for one step, one per logical replica:
/// `[cpu:1] Epoch: 001/003 | Batchsize 001 | Train/Val Loss: 0.48` (a replica that got no
/// sample prints its loss as `-`); in a run of several processes the device is named
/// with its process, `[process 1, cpu:0]`.
pub fn lesson_lines(e: &StepEvent<'_>) -> Vec<String> {
    let width = e.epochs.to_string().len().max(3);
    e.report
        .shards
        .iter()
        .map(|s| {
            let loss = if s.metrics.count == 0 { "-".to_string() } else { format!("{:.2}", s.metrics.mean_loss()) };
            let who = match s.process {
                Some(p) => format!("process {p}, {}", s.device),
                None => s.device.to_string(),
            };
            format!(
                "[{who}] Epoch: {:0width$}/{:0width$} | Batchsize {:03} | Train/Val Loss: {loss}",
                e.epoch + 1,
                e.epochs,
                s.metrics.count
            )
        })
        .collect()
}

/// Where human-readable lines go.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    /// Writes one line, ignoring a closed stream (`lockstep train | head`).
    pub fn line(self, text: &str) {
        let _ = match self {
            Stream::Stdout => writeln!(std::io::stdout().lock(), "{text}"),
            Stream::Stderr => writeln!(std::io::stderr().lock(), "{text}"),
        };
    }

    /// True when the stream is a terminal.
    pub fn is_terminal(self) -> bool {
        match self {
            Stream::Stdout => std::io::stdout().is_terminal(),
            Stream::Stderr => std::io::stderr().is_terminal(),
        }
    }
}

/// Whether [`Progress`] prints the lesson's per-replica line at every step.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum StepLines {
    /// Only the epoch lines (and the bar on a terminal).
    Off,
    /// Every replica's shard loss at every step, in the lesson's form.
    Lesson,
}

/// How [`Progress`] shows the run.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Drawing {
    /// A bar redrawn in place (step, epoch, loss, samples/s, ETA); epoch lines above it.
    Bar,
    /// Plain lines only: what a notebook, a log file or a pipe should get. Inside an
    /// epoch, a line as often as [`Progress::line_every`] says.
    Lines,
}

/// How often [`Progress`] prints a line inside an epoch when it draws no bar.
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Every {
    /// At the first step past this much time since the last line (or the epoch's start).
    Seconds(f64),
    /// Every K steps of the run.
    Steps(u64),
    /// Never: the epoch lines only.
    Never,
}

/// Seconds between the lines inside an epoch when there is no terminal.
pub const LINE_EVERY_SECONDS: f64 = 10.0;

/// Progress for a person: a bar on a terminal, the epoch lines always.
pub struct Progress {
    stream: Stream,
    step_lines: StepLines,
    drawing: Drawing,
    bar: Option<ProgressBar>,
    /// Metrics and training time of the epoch so far (for the bar's loss and rate).
    epoch: Metrics,
    epoch_time: Duration,
    /// What the per-epoch evaluation runs on, for the epoch lines.
    held_out: &'static str,
    /// Lines inside an epoch (`Drawing::Lines`), and when the last one was printed.
    every: Every,
    last_line: Option<Instant>,
}

impl Progress {
    /// A bar when `stream` is a terminal, plain lines otherwise.
    pub fn new(stream: Stream, step_lines: StepLines) -> Progress {
        let drawing = if stream.is_terminal() { Drawing::Bar } else { Drawing::Lines };
        Progress::with_drawing(stream, step_lines, drawing)
    }

    /// Forces the drawing (tests; a terminal that should get plain lines).
    pub fn with_drawing(stream: Stream, step_lines: StepLines, drawing: Drawing) -> Progress {
        Progress {
            stream,
            step_lines,
            drawing,
            bar: None,
            epoch: Metrics::default(),
            epoch_time: Duration::ZERO,
            held_out: "test",
            every: Every::Seconds(LINE_EVERY_SECONDS),
            last_line: None,
        }
    }

    /// How often a line is printed inside an epoch when no bar is drawn (default: every
    /// [`LINE_EVERY_SECONDS`]).
    pub fn line_every(mut self, every: Every) -> Progress {
        self.every = every;
        self
    }

    /// The line inside an epoch: `step 340/1800 (epoch 2/15) | loss 0.4321 | 5100 samples/s
    /// | ETA 1m20s`, the loss and rate those of the epoch so far, the ETA the run's end at
    /// that rate.
    pub fn step_line(&self, e: &StepEvent<'_>) -> String {
        let step = e.report.step + 1;
        let rate = self.epoch.count as f64 / self.epoch_time.as_secs_f64().max(1e-12);
        let per_step = self.epoch_time.as_secs_f64() / (e.step_in_epoch + 1) as f64;
        let eta = per_step * e.total_steps.saturating_sub(step) as f64;
        format!(
            "step {step}/{} (epoch {}/{}) | loss {:.4} | {rate:.0} samples/s | ETA {}",
            e.total_steps,
            e.epoch + 1,
            e.epochs,
            self.epoch.mean_loss(),
            crate::units::duration(Duration::from_secs_f64(eta.min(1e9)))
        )
    }

    /// Whether the line of this step is due (`Drawing::Lines`); the epoch's last step
    /// never prints one, its epoch line follows.
    fn line_due(&mut self, e: &StepEvent<'_>) -> bool {
        let now = Instant::now();
        let last = *self.last_line.get_or_insert(now);
        let due = match self.every {
            Every::Never => false,
            Every::Steps(k) => k > 0 && (e.report.step + 1).is_multiple_of(k),
            Every::Seconds(s) => now.duration_since(last).as_secs_f64() >= s,
        };
        let due = due && e.step_in_epoch + 1 < e.steps_in_epoch;
        if due {
            self.last_line = Some(now);
        }
        due
    }

    /// Names the per-epoch evaluation set in the epoch lines ("test" by default).
    pub fn held_out(mut self, name: &'static str) -> Progress {
        self.held_out = name;
        self
    }

    fn print(&self, text: &str) {
        match &self.bar {
            // Above the bar, which is then redrawn below.
            Some(bar) => bar.suspend(|| self.stream.line(text)),
            None => self.stream.line(text),
        }
    }

    fn bar(&mut self, e: &StepEvent<'_>) -> &ProgressBar {
        let stream = self.stream;
        self.bar.get_or_insert_with(|| {
            let total = e.total_steps;
            let target = match stream {
                Stream::Stdout => ProgressDrawTarget::stdout(),
                Stream::Stderr => ProgressDrawTarget::stderr(),
            };
            let bar = ProgressBar::with_draw_target(Some(total), target);
            bar.set_style(
                // One line of at most 80 columns: the bar takes what the rest leaves.
                ProgressStyle::with_template("{pos:>5}/{len} [{wide_bar:.cyan/blue}] {msg} | ETA {eta}")
                    .expect("the template is valid")
                    .progress_chars("=> "),
            );
            bar
        })
    }

    /// Clears the bar (also done on drop, when a run stops early).
    pub fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}

impl Observer for Progress {
    fn on_step(&mut self, e: &StepEvent<'_>) {
        if self.step_lines == StepLines::Lesson {
            for line in lesson_lines(e) {
                self.print(&line);
            }
        }
        if e.step_in_epoch == 0 {
            self.epoch = Metrics::default();
            self.epoch_time = Duration::ZERO;
        }
        self.epoch.add(&e.report.metrics);
        self.epoch_time += e.report.wall;
        if self.drawing == Drawing::Lines {
            if self.line_due(e) {
                self.print(&self.step_line(e));
            }
            return;
        }
        let msg = format!(
            "epoch {}/{} | loss {:.4} | {:.0} samples/s",
            e.epoch + 1,
            e.epochs,
            self.epoch.mean_loss(),
            self.epoch.count as f64 / self.epoch_time.as_secs_f64().max(1e-12)
        );
        let bar = self.bar(e);
        bar.set_message(msg);
        bar.set_position(e.report.step + 1);
    }

    fn on_epoch(&mut self, e: &EpochReport) {
        // The next epoch's first line comes a period after its start, not after this one's
        // last line (evaluation took some of that time).
        self.last_line = None;
        self.print(&epoch_line(e, self.held_out));
        if e.epoch + 1 == e.epochs {
            self.finish();
        }
    }
}

// ---------------------------------------------------------------------------------------
// JSON lines

/// One JSON object per line: `{"kind":"step",...}` after every step, `{"kind":"epoch",...}`
/// after every epoch (fields in the module docs of the CLI and in [`JsonLines::step_object`],
/// [`JsonLines::epoch_object`]). Each line is written whole with one `write_all`.
pub struct JsonLines<W: Write> {
    out: W,
    error: Option<std::io::Error>,
}

impl<W: Write> JsonLines<W> {
    pub fn new(out: W) -> JsonLines<W> {
        JsonLines { out, error: None }
    }

    /// `{"kind":"step","step","epoch","loss","accuracy","samples","samples_per_sec",
    /// "compute_ms","allreduce_ms","data_wait_ms"}`; compute and all-reduce are the slowest
    /// worker's, samples/s is the batch over the step's wall time on the coordinator.
    pub fn step_object(e: &StepEvent<'_>) -> Value {
        let r = e.report;
        json!({
            "kind": "step",
            "step": r.step + 1,
            "epoch": e.epoch + 1,
            "loss": number(r.metrics.mean_loss()),
            "accuracy": number(r.metrics.accuracy()),
            "samples": r.metrics.count,
            "samples_per_sec": number(step_rate(e)),
            "compute_ms": number(millis(r.compute)),
            "allreduce_ms": number(millis(r.reduce)),
            "data_wait_ms": number(millis(e.data_wait)),
        })
    }

    /// `{"kind":"epoch","epoch","step","train_loss","train_accuracy","val_loss",
    /// "val_accuracy","test_loss","test_accuracy","best","samples_per_sec","seconds"}`: the
    /// held-out set's metrics under its name (`val_*` for a validation split, `test_*` for
    /// the test split), the other pair null; `best` is true for an epoch whose held-out
    /// loss is the lowest so far. `step` is the steps done by the end of the epoch.
    pub fn epoch_object(e: &EpochReport, steps_done: u64) -> Value {
        let pair = |m: &Option<crate::ops::cross_entropy::Metrics>| match m {
            Some(t) => (number(t.mean_loss()), number(t.accuracy())),
            None => (Value::Null, Value::Null),
        };
        let ((val_loss, val_accuracy), (test_loss, test_accuracy)) = (pair(&e.val), pair(&e.test));
        json!({
            "kind": "epoch",
            "epoch": e.epoch + 1,
            "step": steps_done,
            "train_loss": number(e.train.mean_loss()),
            "train_accuracy": number(e.train.accuracy()),
            "val_loss": val_loss,
            "val_accuracy": val_accuracy,
            "test_loss": test_loss,
            "test_accuracy": test_accuracy,
            "best": e.best,
            "samples_per_sec": number(e.samples_per_sec),
            "seconds": number(e.seconds),
        })
    }

    /// `{"kind":"test","step","test_loss","test_accuracy"}` (or `val_*` for a validation
    /// set): a held-out evaluation after the epochs.
    pub fn evaluation_object(e: &EvaluationReport) -> Value {
        let prefix = match e.set {
            crate::train::HeldOut::Test => "test",
            crate::train::HeldOut::Validation => "val",
        };
        let mut v = json!({ "kind": prefix, "step": e.step });
        v[format!("{prefix}_loss")] = number(e.metrics.mean_loss());
        v[format!("{prefix}_accuracy")] = number(e.metrics.accuracy());
        v
    }

    fn emit(&mut self, v: &Value) {
        if self.error.is_some() {
            return;
        }
        let mut line = v.to_string();
        line.push('\n');
        if let Err(e) = self.out.write_all(line.as_bytes()) {
            self.error = Some(e);
        }
    }

    /// Flushes and hands back the writer, or the first write error (named `name`).
    pub fn finish(mut self, name: &Path) -> Result<W> {
        if let Some(e) = self.error.take() {
            return Err(Error::io(name, e));
        }
        self.out.flush().map_err(|e| Error::io(name, e))?;
        Ok(self.out)
    }
}

impl<W: Write> Observer for JsonLines<W> {
    fn on_step(&mut self, e: &StepEvent<'_>) {
        self.emit(&Self::step_object(e));
    }

    fn on_epoch(&mut self, e: &EpochReport) {
        // The report's own count: a run resumed at an epoch's evaluation ends that epoch
        // before any step of its own.
        self.emit(&Self::epoch_object(e, e.step_at_end));
    }

    fn on_evaluation(&mut self, e: &EvaluationReport) {
        self.emit(&Self::evaluation_object(e));
    }
}

// ---------------------------------------------------------------------------------------
// CSV metrics

/// The header of the metrics CSV, which `plot` expects.
pub const CSV_HEADER: &str =
    "kind,step,epoch,loss,accuracy,val_loss,val_accuracy,test_loss,test_accuracy,best,samples_per_sec";

/// How long rows may wait in memory within a long epoch before they are written.
const CSV_FLUSH_EVERY: Duration = Duration::from_secs(5);

/// The metrics CSV: [`CSV_HEADER`], then one `step` row per step (loss and accuracy of
/// its global batch, computed before its update), one `epoch` row per epoch (train loss
/// and accuracy of the epoch; the held-out set's loss and accuracy under its name,
/// `val_*` or `test_*`; `best` 1 for an epoch whose held-out loss is the lowest so far;
/// samples/s), and a `test` row for a test split evaluated after the epochs (its
/// `test_*` cells). Cells that do not apply are empty.
///
/// Crash behaviour: the file is written in place, and rows are kept in memory and
/// written as whole lines at the end of every epoch (and at least every 5 seconds), then
/// flushed. A run that crashes or is killed leaves a readable file holding every step
/// up to the last flush — what one wants of a metrics log, and what a write-then-rename
/// would lose (the half-finished run's curves are exactly what one wants to look at).
/// Only a kill in the middle of that one `write_all` can leave a torn last line.
pub struct CsvMetrics<W: Write> {
    out: W,
    name: PathBuf,
    pending: String,
    last_flush: Instant,
    steps_done: u64,
    error: Option<std::io::Error>,
}

impl CsvMetrics<File> {
    /// Creates (truncates) `path` and writes the header at once, so a path that cannot be
    /// written fails here, before any training.
    pub fn create(path: &Path) -> Result<CsvMetrics<File>> {
        let file = File::create(path).map_err(|e| Error::io(path, e))?;
        let mut csv = CsvMetrics::new(file, path);
        csv.write_pending();
        match csv.error.take() {
            Some(e) => Err(Error::io(path, e)),
            None => Ok(csv),
        }
    }
}

impl<W: Write> CsvMetrics<W> {
    /// A CSV on any writer; `name` names it in errors. The header is written with the
    /// first flush.
    pub fn new(out: W, name: &Path) -> CsvMetrics<W> {
        CsvMetrics {
            out,
            name: name.to_path_buf(),
            pending: format!("{CSV_HEADER}\n"),
            last_flush: Instant::now(),
            steps_done: 0,
            error: None,
        }
    }

    fn write_pending(&mut self) {
        self.last_flush = Instant::now();
        if self.error.is_some() || self.pending.is_empty() {
            self.pending.clear();
            return;
        }
        let result = self.out.write_all(self.pending.as_bytes()).and_then(|()| self.out.flush());
        self.pending.clear();
        if let Err(e) = result {
            self.error = Some(e);
        }
    }

    /// Writes what is pending and hands back the writer, or the first write error.
    pub fn finish(mut self) -> Result<W> {
        self.write_pending();
        match self.error.take() {
            Some(e) => Err(Error::io(&self.name, e)),
            None => Ok(self.out),
        }
    }
}

/// Loss and accuracy cells, empty without metrics.
fn cells(m: &Option<crate::ops::cross_entropy::Metrics>) -> (String, String) {
    match m {
        Some(t) => (t.mean_loss().to_string(), t.accuracy().to_string()),
        None => (String::new(), String::new()),
    }
}

impl<W: Write> Observer for CsvMetrics<W> {
    fn on_step(&mut self, e: &StepEvent<'_>) {
        let m = &e.report.metrics;
        self.steps_done = e.report.step + 1;
        let _ = writeln!(
            self.pending,
            "step,{},{},{},{},,,,,,{}",
            self.steps_done,
            e.epoch + 1,
            m.mean_loss(),
            m.accuracy(),
            step_rate(e)
        );
        if self.last_flush.elapsed() >= CSV_FLUSH_EVERY {
            self.write_pending();
        }
    }

    fn on_epoch(&mut self, e: &EpochReport) {
        let ((vl, va), (tl, ta)) = (cells(&e.val), cells(&e.test));
        let best = if e.held_out().is_some() { u8::from(e.best).to_string() } else { String::new() };
        let _ = writeln!(
            self.pending,
            "epoch,{},{},{},{},{vl},{va},{tl},{ta},{best},{}",
            e.step_at_end,
            e.epoch + 1,
            e.train.mean_loss(),
            e.train.accuracy(),
            e.samples_per_sec
        );
        self.write_pending();
    }

    fn on_evaluation(&mut self, e: &EvaluationReport) {
        let (loss, accuracy) = cells(&Some(e.metrics));
        let row = match e.set {
            crate::train::HeldOut::Test => format!("test,{},,,,,,{loss},{accuracy},,", e.step),
            crate::train::HeldOut::Validation => format!("val,{},,,,{loss},{accuracy},,,,", e.step),
        };
        let _ = writeln!(self.pending, "{row}");
        self.write_pending();
    }
}

// ---------------------------------------------------------------------------------------
// Fan-out

/// Several observers run together, in the order given; the caller keeps ownership (so
/// that it can `finish` each one after the run).
#[derive(Default)]
pub struct Fanout<'a> {
    observers: Vec<&'a mut dyn Observer>,
}

impl<'a> Fanout<'a> {
    pub fn new() -> Fanout<'a> {
        Fanout { observers: Vec::new() }
    }

    /// Adds an observer after those already there.
    pub fn push(&mut self, observer: &'a mut dyn Observer) -> &mut Self {
        self.observers.push(observer);
        self
    }
}

impl Observer for Fanout<'_> {
    fn on_step(&mut self, e: &StepEvent<'_>) {
        for o in &mut self.observers {
            o.on_step(e);
        }
    }

    fn on_epoch(&mut self, e: &EpochReport) {
        for o in &mut self.observers {
            o.on_epoch(e);
        }
    }

    fn on_evaluation(&mut self, e: &EvaluationReport) {
        for o in &mut self.observers {
            o.on_evaluation(e);
        }
    }
}

/// Owned observers run together, in order.
impl Observer for Vec<Box<dyn Observer>> {
    fn on_step(&mut self, e: &StepEvent<'_>) {
        for o in self.iter_mut() {
            o.on_step(e);
        }
    }

    fn on_epoch(&mut self, e: &EpochReport) {
        for o in self.iter_mut() {
            o.on_epoch(e);
        }
    }

    fn on_evaluation(&mut self, e: &EvaluationReport) {
        for o in self.iter_mut() {
            o.on_evaluation(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::{ShardReport, StepReport};
    use crate::Device;

    /// A step of 32 samples: loss sum 16 → mean 0.5, 24 correct → accuracy 0.75, wall
    /// 10 ms → 3200 samples/s; compute 6 ms, reduce 2 ms, data wait 1 ms.
    fn report() -> StepReport {
        let m = Metrics { loss_sum: 16.0, correct: 24, count: 32 };
        StepReport {
            step: 4,
            metrics: m,
            shards: vec![ShardReport { device: Device::Cpu(0), process: None, shard: 0, metrics: m }],
            compute: Duration::from_millis(6),
            reduce: Duration::from_millis(2),
            wall: Duration::from_millis(10),
        }
    }

    fn event(r: &StepReport) -> StepEvent<'_> {
        StepEvent {
            report: r,
            epoch: 1,
            epochs: 3,
            step_in_epoch: 1,
            steps_in_epoch: 3,
            total_steps: 9,
            data_wait: Duration::from_millis(1),
        }
    }

    /// Epoch 2 of 3: train loss 40/100 = 0.4, accuracy 90/100; test 3/10 = 0.3, 9/10.
    fn epoch(test: bool) -> EpochReport {
        EpochReport {
            epoch: 1,
            epochs: 3,
            train: Metrics { loss_sum: 40.0, correct: 90, count: 100 },
            test: test.then_some(Metrics { loss_sum: 3.0, correct: 9, count: 10 }),
            val: None,
            best: false,
            steps: 3,
            step_at_end: 6,
            seconds: 0.5,
            samples_per_sec: 200.0,
            steps_of_run: None,
        }
    }

    /// The same epoch with its held-out set a validation split, the best so far.
    fn validated() -> EpochReport {
        let e = epoch(true);
        EpochReport { val: e.test, test: None, best: true, ..e }
    }

    fn close(a: &Value, b: f64) -> bool {
        (a.as_f64().unwrap() - b).abs() < 1e-9
    }

    #[test]
    fn without_a_terminal_a_line_comes_as_often_as_asked_inside_an_epoch() {
        let mut r = report();
        let progress = |every| Progress::with_drawing(Stream::Stderr, StepLines::Off, Drawing::Lines).line_every(every);
        // Every 2 steps of the run, never on an epoch's last step (its epoch line follows).
        let mut p = progress(Every::Steps(2));
        let mut due = Vec::new();
        for (step, in_epoch) in [(3, 0), (4, 1), (5, 2), (6, 0)] {
            r.step = step;
            let e = StepEvent { step_in_epoch: in_epoch, ..event(&r) };
            p.on_step(&e);
            due.push(p.line_due(&e));
        }
        // Steps done 4, 5, 6 and 7: the 4th prints; the 6th, its epoch's last, does not.
        assert_eq!(due, [true, false, false, false]);
        // By time: nothing before the period has passed, then a line.
        let mut p = progress(Every::Seconds(0.05));
        let e = event(&r);
        p.on_step(&e);
        assert!(!p.line_due(&e));
        std::thread::sleep(Duration::from_millis(60));
        assert!(p.line_due(&e) && !p.line_due(&e));
        assert!(!progress(Every::Never).line_due(&e));
        // The epoch so far: one step of 32 samples in 10 ms; 9 - 7 steps to go at 10 ms.
        let mut p = progress(Every::Never);
        r.step = 6;
        let e = StepEvent { step_in_epoch: 0, ..event(&r) };
        p.on_step(&e);
        assert_eq!(p.step_line(&e), "step 7/9 (epoch 2/3) | loss 0.5000 | 3200 samples/s | ETA 0.0s");
    }

    #[test]
    fn json_lines_parse_back_with_the_event_values() {
        let r = report();
        let mut j = JsonLines::new(Vec::new());
        j.on_step(&event(&r));
        j.on_epoch(&epoch(true));
        j.on_epoch(&epoch(false));
        let text = String::from_utf8(j.finish(Path::new("mem")).unwrap()).unwrap();
        let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), 3);
        let s = &lines[0];
        assert_eq!(s["kind"], "step");
        // 0-based step 4 is the 5th step; 0-based epoch 1 is epoch 2.
        assert_eq!(s["step"], 5);
        assert_eq!(s["epoch"], 2);
        assert_eq!(s["samples"], 32);
        assert!(close(&s["loss"], 0.5) && close(&s["accuracy"], 0.75));
        assert!(close(&s["samples_per_sec"], 3200.0));
        assert!(close(&s["compute_ms"], 6.0) && close(&s["allreduce_ms"], 2.0) && close(&s["data_wait_ms"], 1.0));
        let e = &lines[1];
        assert_eq!(e["kind"], "epoch");
        assert_eq!(e["epoch"], 2);
        // The epoch's own count of steps at its end (`epoch`'s `step_at_end`).
        assert_eq!(e["step"], 6);
        assert!(close(&e["train_loss"], 0.4) && close(&e["train_accuracy"], 0.9));
        // The held-out set is the test split here: test_*, and no val_*.
        assert!(close(&e["test_loss"], 0.3) && close(&e["test_accuracy"], 0.9));
        assert!(e["val_loss"].is_null() && e["val_accuracy"].is_null() && e["best"] == false);
        assert!(close(&e["samples_per_sec"], 200.0) && close(&e["seconds"], 0.5));
        for k in ["val_loss", "val_accuracy", "test_loss", "test_accuracy"] {
            assert!(lines[2][k].is_null(), "{k}");
        }
    }

    #[test]
    fn a_validation_set_is_val_and_the_final_test_is_test() {
        let mut j = JsonLines::new(Vec::new());
        j.on_epoch(&validated());
        let m = Metrics { loss_sum: 2.0, correct: 8, count: 10 };
        j.on_evaluation(&EvaluationReport { set: crate::train::HeldOut::Test, step: 9, metrics: m });
        let text = String::from_utf8(j.finish(Path::new("mem")).unwrap()).unwrap();
        let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        // `validated`: validation loss 3/10 = 0.3, accuracy 0.9, the best epoch.
        assert!(close(&lines[0]["val_loss"], 0.3) && close(&lines[0]["val_accuracy"], 0.9));
        assert!(lines[0]["test_loss"].is_null() && lines[0]["best"] == true);
        // The test split after the epochs: loss 2/10, accuracy 8/10.
        assert_eq!(lines[1]["kind"], "test");
        assert_eq!(lines[1]["step"], 9);
        assert!(close(&lines[1]["test_loss"], 0.2) && close(&lines[1]["test_accuracy"], 0.8));
        let mut c = CsvMetrics::new(Vec::new(), Path::new("mem.csv"));
        c.on_epoch(&validated());
        c.on_evaluation(&EvaluationReport { set: crate::train::HeldOut::Test, step: 9, metrics: m });
        let text = String::from_utf8(c.finish().unwrap()).unwrap();
        let rows: Vec<&str> = text.lines().collect();
        // Step 6: the epoch's `step_at_end`, with no step row before it.
        assert_eq!(rows[1], "epoch,6,2,0.4,0.9,0.3,0.9,,,1,200");
        assert_eq!(rows[2], "test,9,,,,,,0.2,0.8,,");
        assert_eq!(
            epoch_line(&validated(), "validation"),
            "epoch 2/3 | train loss 0.4000 acc 0.9000 | validation loss 0.3000 acc 0.9000 | 200 samples/s | 0.50s | best"
        );
    }

    #[test]
    fn non_finite_numbers_are_json_null() {
        let mut r = report();
        r.metrics.loss_sum = f64::NAN;
        // No sample: accuracy 0/0 is NaN, the rate is 0.
        let mut empty = report();
        empty.metrics = Metrics::default();
        let mut j = JsonLines::new(Vec::new());
        j.on_step(&event(&r));
        j.on_step(&event(&empty));
        let text = String::from_utf8(j.finish(Path::new("mem")).unwrap()).unwrap();
        let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).expect("valid JSON")).collect();
        assert!(lines[0]["loss"].is_null());
        assert!(close(&lines[0]["accuracy"], 0.75));
        assert!(lines[1]["loss"].is_null() && lines[1]["accuracy"].is_null());
        assert!(close(&lines[1]["samples_per_sec"], 0.0));
    }

    #[test]
    fn csv_has_the_header_a_row_per_step_and_per_epoch() {
        let r = report();
        let mut c = CsvMetrics::new(Vec::new(), Path::new("mem.csv"));
        c.on_step(&event(&r));
        c.on_epoch(&epoch(true));
        c.on_epoch(&epoch(false));
        let text = String::from_utf8(c.finish().unwrap()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], CSV_HEADER);
        // Values from `report` and `epoch`, see their docs.
        assert_eq!(lines[1], "step,5,2,0.5,0.75,,,,,,3200");
        // The held-out set is the test split: its cells are test_*, and best is 0; the
        // step is the epoch's own `step_at_end`, 6.
        assert_eq!(lines[2], "epoch,6,2,0.4,0.9,,,0.3,0.9,0,200");
        assert_eq!(lines[3], "epoch,6,2,0.4,0.9,,,,,,200");
        assert_eq!(lines.len(), 4);
    }

    #[test]
    fn csv_rows_reach_the_writer_at_each_epoch() {
        let r = report();
        let mut c = CsvMetrics::new(Vec::new(), Path::new("mem.csv"));
        c.on_step(&event(&r));
        // Nothing written mid-epoch (less than 5 s since the start).
        assert!(c.out.is_empty());
        c.on_epoch(&epoch(false));
        assert_eq!(String::from_utf8_lossy(&c.out).lines().count(), 3);
    }

    #[test]
    fn write_errors_are_kept_for_finish() {
        struct Full;
        impl Write for Full {
            fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
                Err(std::io::Error::other("disk full"))
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let mut c = CsvMetrics::new(Full, Path::new("m.csv"));
        c.on_epoch(&epoch(false));
        let err = c.finish().err().unwrap().to_string();
        assert!(err.contains("m.csv") && err.contains("disk full"), "{err}");
    }

    #[test]
    fn epoch_and_lesson_lines_keep_the_cli_format() {
        assert_eq!(
            epoch_line(&epoch(true), "test"),
            "epoch 2/3 | train loss 0.4000 acc 0.9000 | test loss 0.3000 acc 0.9000 | 200 samples/s | 0.50s"
        );
        let r = report();
        assert_eq!(lesson_lines(&event(&r)), vec!["[cpu:0] Epoch: 002/003 | Batchsize 032 | Train/Val Loss: 0.50"]);
        let mut across = report();
        across.shards[0].process = Some(1);
        assert_eq!(
            lesson_lines(&event(&across)),
            vec!["[process 1, cpu:0] Epoch: 002/003 | Batchsize 032 | Train/Val Loss: 0.50"]
        );
    }

    #[test]
    fn fanout_calls_every_observer() {
        let r = report();
        let mut a = JsonLines::new(Vec::new());
        let mut b = CsvMetrics::new(Vec::new(), Path::new("mem.csv"));
        {
            let mut f = Fanout::new();
            f.push(&mut a).push(&mut b);
            f.on_step(&event(&r));
            f.on_epoch(&epoch(false));
        }
        assert_eq!(String::from_utf8(a.finish(Path::new("mem")).unwrap()).unwrap().lines().count(), 2);
        assert_eq!(String::from_utf8(b.finish().unwrap()).unwrap().lines().count(), 3);
    }
}
