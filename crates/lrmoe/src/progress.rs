//! The progress bar and the log share stderr without overwriting each
//! other: log lines go through [`LogWriter`], which hides the bar (if one
//! is shown) while it writes a line, then redraws it.

use std::io::Write;
use std::sync::Mutex;

use indicatif::ProgressBar;

static BAR: Mutex<Option<ProgressBar>> = Mutex::new(None);

/// Shows `bar` until [`hide`]; log lines are printed above it meanwhile.
pub fn show(bar: &ProgressBar) {
    *BAR.lock().unwrap_or_else(|p| p.into_inner()) = Some(bar.clone());
}

/// Clears the bar shown by [`show`].
pub fn hide() {
    if let Some(b) = BAR.lock().unwrap_or_else(|p| p.into_inner()).take() {
        b.finish_and_clear();
    }
}

/// A `tracing_subscriber` writer for stderr that suspends the progress
/// bar while each event is written (one event is one buffered write).
#[derive(Debug, Default)]
pub struct LogWriter(Vec<u8>);

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.0.is_empty() {
            return Ok(());
        }
        let bytes = std::mem::take(&mut self.0);
        let bar = BAR.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let write = || std::io::stderr().lock().write_all(&bytes);
        match bar {
            Some(b) => b.suspend(write),
            None => write(),
        }
    }
}

impl Drop for LogWriter {
    fn drop(&mut self) {
        let _ = self.flush();
    }
}

/// For `tracing_subscriber::fmt().with_writer(progress::make_writer)`.
pub fn make_writer() -> LogWriter {
    LogWriter::default()
}
