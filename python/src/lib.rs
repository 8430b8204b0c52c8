//! `lockstep._lockstep`, the Python package's native module: `train`, the library's hosted
//! run (`lockstep::cli::hosted`) with the interpreter's lock released for the whole run,
//! taken back only at step boundaries, briefly, to pass the host's events on and to look
//! for Ctrl-C. What the arrays are, and what is checked before they get here, is
//! `lockstep/__init__.py`'s; what is checked of the flags and the data, the library's.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use lockstep::cli::hosted::{self, Array, Data, HostedRun, Refusal, Samples};
use lockstep::train::{EpochReport, Observer, StepEvent, Stopped};
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

/// An array as the Python side hands it over: (dtype name, shape, address of its first
/// byte, its length in bytes). The Python side holds the array, C-contiguous, until
/// `train` returns.
type RawArray = (String, Vec<usize>, usize, usize);

/// What a run reads: samples as an array, or a text's bytes.
enum Input {
    Text(Vec<u8>),
    Array(RawArray),
}

impl<'a, 'py> FromPyObject<'a, 'py> for Input {
    type Error = PyErr;

    fn extract(x: Borrowed<'a, 'py, PyAny>) -> PyResult<Input> {
        match x.cast::<PyBytes>() {
            // One copy of the text, as a file's bytes are read.
            Ok(b) => Ok(Input::Text(b.as_bytes().to_vec())),
            Err(_) => Ok(Input::Array(x.extract()?)),
        }
    }
}

/// The bytes of a [`RawArray`].
///
/// # Safety
/// `address` must point at `len` readable bytes that stay alive and unchanged while the
/// returned slice is used (the Python side keeps the array referenced until `train` has
/// returned, and the run only reads it).
unsafe fn bytes<'a>(address: usize, len: usize) -> &'a [u8] {
    if len == 0 {
        return &[];
    }
    // SAFETY: the caller's promise above; a non-empty numpy array's data pointer is
    // non-null.
    unsafe { std::slice::from_raw_parts(address as *const u8, len) }
}

/// The host's observer: each event a call of `callback(kind, fields)` under the lock,
/// and at every step a look for a signal Python caught (Ctrl-C, the notebook's stop
/// button): its exception raises the run's stop, and is kept to say so.
struct PyObserver {
    callback: Option<Py<PyAny>>,
    stop: Arc<AtomicBool>,
    interrupt: Option<PyErr>,
    failure: Option<PyErr>,
}

impl PyObserver {
    fn call(&mut self, py: Python<'_>, kind: &str, fields: Bound<'_, PyDict>) {
        if let (Some(cb), None) = (&self.callback, &self.failure) {
            if let Err(e) = cb.call1(py, (kind, fields)) {
                // A callback that fails stops the run; its exception is raised after it.
                self.failure = Some(e);
                self.stop.store(true, Ordering::SeqCst);
            }
        }
    }
}

impl Observer for PyObserver {
    fn on_step(&mut self, e: &StepEvent<'_>) {
        Python::attach(|py| {
            if let Err(err) = py.check_signals() {
                self.stop.store(true, Ordering::SeqCst);
                self.interrupt.get_or_insert(err);
            }
            if self.callback.is_none() {
                return;
            }
            let d = PyDict::new(py);
            // Steps counted from 1, as the command line's lines count them.
            let _ = d.set_item("step", e.report.step + 1);
            let _ = d.set_item("total_steps", e.total_steps);
            let _ = d.set_item("epoch", e.epoch);
            let _ = d.set_item("epochs", e.epochs);
            let _ = d.set_item("loss", e.report.metrics.mean_loss());
            self.call(py, "step", d);
        })
    }

    fn on_epoch(&mut self, e: &EpochReport) {
        Python::attach(|py| {
            let d = epoch_dict(py, e);
            self.call(py, "epoch", d);
        })
    }
}

/// An epoch's row: its metrics as Keras names them.
fn epoch_dict<'py>(py: Python<'py>, e: &EpochReport) -> Bound<'py, PyDict> {
    let d = PyDict::new(py);
    let _ = d.set_item("epoch", e.epoch);
    let _ = d.set_item("epochs", e.epochs);
    let _ = d.set_item("step", e.step_at_end);
    let _ = d.set_item("loss", e.train.mean_loss());
    let _ = d.set_item("accuracy", e.train.accuracy());
    if let Some(m) = e.held_out() {
        let _ = d.set_item("val_loss", m.mean_loss());
        let _ = d.set_item("val_accuracy", m.accuracy());
    }
    let _ = d.set_item("samples_per_sec", e.samples_per_sec);
    let _ = d.set_item("seconds", e.seconds);
    let _ = d.set_item("best", e.best);
    d
}

fn raise(r: Refusal) -> PyErr {
    match r {
        Refusal::Usage(m) => PyValueError::new_err(m),
        Refusal::File(m) => PyOSError::new_err(m),
        Refusal::Run(m) => PyRuntimeError::new_err(m),
    }
}

/// train(flags, x, y, held_out, say, callback) -> dict: `lockstep train` with `flags`
/// on samples x and labels y (and the held-out (x, y) or None), each a (dtype, shape,
/// address, length) of a C-contiguous array the caller keeps alive, or on a text: x
/// bytes, y and held_out None; `say(line)` gets the run's lines, `callback(kind, fields)`
/// its steps and epochs; `model_name` what the lines call the model. Returns the report's fields, the weights as safetensors bytes
/// and the report's HTML.
#[pyfunction]
#[pyo3(signature = (flags, x, y, held_out, say, callback, model_name=None))]
#[allow(clippy::too_many_arguments)]
fn train(
    py: Python<'_>,
    flags: Vec<String>,
    x: Input,
    y: Option<RawArray>,
    held_out: Option<(RawArray, RawArray)>,
    say: Py<PyAny>,
    callback: Option<Py<PyAny>>,
    model_name: Option<String>,
) -> PyResult<Py<PyDict>> {
    let data = match (&x, &y) {
        (Input::Text(bytes), None) => Data::Text(bytes),
        (Input::Array(ids), None) => Data::Tokens(array(ids)),
        (Input::Array(x), Some(y)) => {
            Data::Samples { train: samples(x, y), held_out: held_out.as_ref().map(|(hx, hy)| samples(hx, hy)) }
        }
        _ => return Err(PyValueError::new_err("train: samples come with labels, and a text without")),
    };
    // Under the lock: no Python thread can write the arrays while they are copied.
    let prepared = hosted::prepare(flags, data).map_err(raise)?;
    let stop = Arc::new(AtomicBool::new(false));
    let mut observer = PyObserver { callback, stop: Arc::clone(&stop), interrupt: None, failure: None };
    let say_line = |line: String| {
        Python::attach(|py| {
            let _ = say.call1(py, (line,));
        })
    };
    let trained = py.detach(|| {
        hosted::train(HostedRun {
            prepared,
            model_name,
            say: &say_line,
            observer: &mut observer,
            stop: Arc::clone(&stop),
        })
    });
    if let Some(e) = observer.failure.take() {
        return Err(e);
    }
    let trained = trained.map_err(raise)?;
    let r = &trained.report;
    let out = PyDict::new(py);
    let epochs = PyList::empty(py);
    for e in &r.epochs {
        epochs.append(epoch_dict(py, e))?;
    }
    out.set_item("epochs", epochs)?;
    out.set_item("weights", PyBytes::new(py, &trained.weights))?;
    out.set_item("steps", r.steps)?;
    out.set_item("seconds", r.seconds)?;
    out.set_item("samples_per_sec", r.samples_per_sec)?;
    out.set_item("held_out", trained.held_out.name())?;
    let stopped = match &r.stopped {
        Stopped::Completed => "completed",
        Stopped::EarlyStopping { .. } => "early_stopping",
        Stopped::Interrupted { .. } => "interrupted",
        Stopped::TimeLimit { .. } => "time_limit",
    };
    out.set_item("stopped", stopped)?;
    out.set_item("report", r.to_string())?;
    out.set_item("html", lockstep::notebook::html(r))?;
    Ok(out.unbind())
}

/// An array's copy, owned here.
struct Owned {
    dtype: String,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl Owned {
    fn array(&self) -> Array<'_> {
        Array { dtype: &self.dtype, shape: self.shape.clone(), bytes: &self.bytes }
    }
}

/// A copy of the caller's array (taken while the interpreter's lock is held).
fn owned(a: &RawArray) -> Owned {
    // SAFETY: as in `array`: the caller holds the array, C-contiguous, until the call
    // returns; the lock is held, so no Python thread writes it meanwhile.
    Owned { dtype: a.0.clone(), shape: a.1.clone(), bytes: unsafe { bytes(a.2, a.3) }.to_vec() }
}

/// Samples and labels from the caller's arrays.
fn samples<'a>(x: &'a RawArray, y: &'a RawArray) -> Samples<'a> {
    Samples { x: array(x), y: array(y) }
}

/// The caller's array.
fn array(a: &RawArray) -> Array<'_> {
    Array {
        dtype: &a.0,
        shape: a.1.clone(),
        // SAFETY: `train`'s contract (its doc and lockstep/__init__.py): the caller holds
        // each array, C-contiguous, until `train` returns, and these slices live no
        // longer than its arguments; they are read (copied into the run's datasets,
        // `hosted::prepare`) while the interpreter's lock is held, so no Python thread
        // writes them meanwhile.
        bytes: unsafe { bytes(a.2, a.3) },
    }
}

/// The `lockstep` binary's allocator (src/main.rs), for the allocations of this module's
/// runs: the interpreter's own memory stays the interpreter's, and no allocation crosses
/// between the two (what Python is handed it copies).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// evaluate(flags, x, y) -> dict: `lockstep eval` with `flags` (no `--data`) on samples x
/// and labels y (arrays as `train` takes them): loss, accuracy, correct, count, classes,
/// and every sample's probabilities as f32 bytes.
#[pyfunction]
fn evaluate(py: Python<'_>, flags: Vec<String>, x: RawArray, y: RawArray) -> PyResult<Py<PyDict>> {
    // Copied while the lock is held, so that no Python thread writes them as they are read.
    let (x, y) = (owned(&x), owned(&y));
    let data = Samples { x: x.array(), y: y.array() };
    let e = py.detach(|| hosted::evaluate(flags, &data)).map_err(raise)?;
    let out = PyDict::new(py);
    out.set_item("loss", e.loss)?;
    out.set_item("accuracy", e.accuracy)?;
    out.set_item("correct", e.correct)?;
    out.set_item("count", e.count)?;
    out.set_item("classes", e.classes)?;
    out.set_item("probabilities", PyBytes::new(py, &f32_bytes(&e.probabilities)))?;
    Ok(out.unbind())
}

/// predict(flags, x) -> (classes, bytes): `lockstep predict` with `flags` (no `--data`) on
/// inputs x: the model's classes and every input's probabilities as f32 bytes.
#[pyfunction]
fn predict(py: Python<'_>, flags: Vec<String>, x: RawArray) -> PyResult<(usize, Py<PyBytes>)> {
    // Copied while the lock is held, so that no Python thread writes them as they are read.
    let x = owned(&x);
    let inputs = x.array();
    let (k, p) = py.detach(|| hosted::predict(flags, &inputs)).map_err(raise)?;
    Ok((k, PyBytes::new(py, &f32_bytes(&p)).unbind()))
}

/// generate(flags) -> bytes: `lockstep generate` with `flags`: the bytes it would print.
#[pyfunction]
fn generate(py: Python<'_>, flags: Vec<String>) -> PyResult<Py<PyBytes>> {
    let text = py.detach(|| hosted::generate(flags)).map_err(raise)?;
    Ok(PyBytes::new(py, &text).unbind())
}

/// Little-endian bytes of f32 values.
fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// builtin_models() -> list: the built-in models' names, as `--model` takes them.
#[pyfunction]
fn builtin_models() -> Vec<&'static str> {
    hosted::builtin_models()
}

#[pymodule]
fn _lockstep(m: &Bound<'_, PyModule>) -> PyResult<()> {
    lockstep::cli::allocator::keep_freed_pages();
    m.add_function(wrap_pyfunction!(train, m)?)?;
    m.add_function(wrap_pyfunction!(evaluate, m)?)?;
    m.add_function(wrap_pyfunction!(predict, m)?)?;
    m.add_function(wrap_pyfunction!(generate, m)?)?;
    m.add_function(wrap_pyfunction!(builtin_models, m)?)?;
    Ok(())
}
