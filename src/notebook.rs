//! lockstep in a Jupyter notebook (the `notebook` feature): what a cell shows when its
//! last expression is a run's report or its curves.
//!
//! The Rust kernel, evcxr, calls a value's `evcxr_display` method when it has one, and
//! reads what it prints between `EVCXR_BEGIN_CONTENT <mime type>` and `EVCXR_END_CONTENT`
//! as one output of that type; several types make one bundle, of which the notebook shows
//! the richest it can. A [`TrainReport`] gives its `Display` as text/plain and, as
//! text/html, a table of its epochs above the curves ([`html`]); a [`MetricsTable`] gives
//! the figure as image/png. Nothing here runs without evcxr asking, and nothing needs it:
//! [`html`] is a string, `plot::png` bytes.
//!
//! Left to others: the figure (`plot`), the report's words (`train::report`).

use std::fmt::Write as _;

use base64::Engine as _;

use crate::plot::{self, MetricsTable, XAxis};
use crate::train::{Stopped, TrainReport};

/// One output of a cell, in evcxr's protocol.
fn send(mime: &str, content: &str) {
    println!("EVCXR_BEGIN_CONTENT {mime}\n{content}\nEVCXR_END_CONTENT");
}

/// Text that HTML shows as written.
fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// The report as HTML: a table with a row per epoch (train loss and accuracy, the
/// held-out set's, samples/s, seconds, the best epoch marked), the summary line of its
/// `Display`, and the curves as an inline PNG (left out, with the reason, if they cannot
/// be drawn).
pub fn html(report: &TrainReport) -> String {
    // The curves' table also says what the held-out set is.
    let table = MetricsTable::from(report);
    let held = table.held_out;
    let unit = if report.epochs.first().is_some_and(|e| e.steps_of_run.is_some()) { "tokens/s" } else { "samples/s" };
    let mut h = String::from("<div class=\"lockstep-report\">\n<table>\n<thead><tr><th>epoch</th><th>step</th>");
    h.push_str("<th>train loss</th><th>train accuracy</th>");
    if let Some(set) = held {
        let _ = write!(h, "<th>{0} loss</th><th>{0} accuracy</th>", set.name());
    }
    let _ = write!(h, "<th>{unit}</th><th>seconds</th><th></th></tr></thead>\n<tbody>\n");
    for e in &report.epochs {
        let _ = write!(
            h,
            "<tr><td>{}/{}</td><td>{}</td><td>{:.4}</td><td>{:.4}</td>",
            e.epoch + 1,
            e.epochs,
            e.step_at_end,
            e.train.mean_loss(),
            e.train.accuracy()
        );
        if held.is_some() {
            match e.held_out() {
                Some(m) => {
                    let _ = write!(h, "<td>{:.4}</td><td>{:.4}</td>", m.mean_loss(), m.accuracy());
                }
                None => h.push_str("<td></td><td></td>"),
            }
        }
        let best = if e.best { "best" } else { "" };
        let _ = writeln!(h, "<td>{:.0}</td><td>{:.2}</td><td>{best}</td></tr>", e.samples_per_sec, e.seconds);
    }
    h.push_str("</tbody>\n</table>\n");
    let summary = report.to_string();
    let _ = writeln!(h, "<p>{}</p>", escape(summary.lines().last().unwrap_or_default()));
    if let Stopped::TimeLimit { .. } | Stopped::Interrupted { .. } = report.stopped {
        h.push_str("<p>The run stopped before its end: the last epoch row is the last one it finished.</p>\n");
    }
    match plot::png(&table, "Training curves", XAxis::Step) {
        Ok(png) => {
            let data = base64::engine::general_purpose::STANDARD.encode(png);
            let _ = writeln!(
                h,
                "<img alt=\"training curves\" style=\"max-width:100%\" src=\"data:image/png;base64,{data}\">"
            );
        }
        Err(e) => {
            let _ = writeln!(h, "<p>(no curves: {})</p>", escape(&e.to_string()));
        }
    }
    h.push_str("</div>");
    h
}

impl TrainReport {
    /// What a notebook cell ending with a report shows: its table and curves
    /// ([`html`]), or its `Display` where HTML is not shown.
    pub fn evcxr_display(&self) {
        send("text/plain", &self.to_string());
        send("text/html", &html(self));
    }
}

impl MetricsTable {
    /// What a notebook cell ending with a table shows: its figure, steps on the axis.
    pub fn evcxr_display(&self) {
        match plot::png(self, "Training curves", XAxis::Step) {
            Ok(png) => send("image/png", &base64::engine::general_purpose::STANDARD.encode(png)),
            Err(e) => send("text/plain", &format!("(no figure: {e})")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::{train_data_parallel, TrainConfig};

    #[test]
    fn a_reports_html_has_a_row_per_epoch_and_its_curves_inline() {
        let splits = crate::data::toy::toy_enlarged(40, 3).unwrap();
        let model = crate::models::toy_mlp(2, 2).unwrap();
        let config = TrainConfig { epochs: 3, batch_size: 16, ..TrainConfig::default() };
        let devices = crate::devices::Devices::cpu(2, 1).unwrap();
        let report = train_data_parallel(&model, &splits.train, splits.test.as_ref(), &devices, &config).unwrap();
        let h = html(&report);
        assert_eq!(h.matches("<tr><td>").count(), 3, "{h}");
        assert!(h.contains("<th>test loss</th><th>test accuracy</th>"), "{h}");
        let e = &report.epochs[2];
        let row = format!("<tr><td>3/3</td><td>{}</td><td>{:.4}</td>", e.step_at_end, e.train.mean_loss());
        assert!(h.contains(&row), "{h}");
        assert!(h.contains(&format!("<p>trained {} steps in ", report.steps)), "{h}");
        // The image decodes back to the figure's PNG.
        let data = h.split("base64,").nth(1).unwrap().split('"').next().unwrap();
        let png = base64::engine::general_purpose::STANDARD.decode(data).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        assert_eq!(escape("a<b & \"c\">"), "a&lt;b &amp; &quot;c&quot;&gt;");
    }
}
