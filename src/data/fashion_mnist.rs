//! Fashion-MNIST without a download: where Debian's `dataset-fashion-mnist` package puts
//! the real IDX files (60,000 training and 10,000 test images of 28×28, 10 classes), the
//! environment variable that points elsewhere, and the class names.
//!
//! Owns: finding the directory and saying what to install when it is absent. Reading
//! the files is `idx`'s ([`load_mnist_dir`]), whose checks (magic, sizes, labels in
//! 0..9) apply unchanged.

use std::path::{Path, PathBuf};

use super::idx::load_mnist_dir;
use super::Splits;
use crate::error::{Error, Result};

/// Where `apt-get install dataset-fashion-mnist` puts the four gzipped IDX files.
pub const DEBIAN_DIR: &str = "/usr/share/datasets/fashion-mnist";

/// The Debian package that provides them.
pub const DEBIAN_PACKAGE: &str = "dataset-fashion-mnist";

/// A directory that takes the place of [`DEBIAN_DIR`] when set (a copy elsewhere, or the
/// files downloaded from Zalando's repository).
pub const DIR_ENV: &str = "LOCKSTEP_FASHION_MNIST_DIR";

/// The ten classes, in label order (Zalando's README).
pub const CLASS_NAMES: [&str; 10] =
    ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"];

/// The directory holding the files: `$LOCKSTEP_FASHION_MNIST_DIR` when set, else
/// [`DEBIAN_DIR`]. An error when it is not a directory says which package to install.
pub fn fashion_mnist_dir() -> Result<PathBuf> {
    find_dir(std::env::var_os(DIR_ENV), Path::new(DEBIAN_DIR))
}

/// [`fashion_mnist_dir`] with the environment variable's value and the package's
/// directory given (so that a test can name a directory that is not there).
fn find_dir(env: Option<std::ffi::OsString>, debian: &Path) -> Result<PathBuf> {
    if let Some(dir) = env.filter(|d| !d.is_empty()) {
        let dir = PathBuf::from(dir);
        if !dir.is_dir() {
            return Err(Error::format(
                &dir,
                format!(
                    "not a directory (named by {DIR_ENV}); unset it to use {DEBIAN_DIR} from Debian's {DEBIAN_PACKAGE} package"
                ),
            ));
        }
        return Ok(dir);
    }
    if !debian.is_dir() {
        return Err(Error::format(
            debian,
            format!(
                "not found: install Debian's {DEBIAN_PACKAGE} package (apt-get install {DEBIAN_PACKAGE}), or point {DIR_ENV} at a directory of the four Fashion-MNIST IDX files"
            ),
        ));
    }
    Ok(debian.to_path_buf())
}

/// The training and test splits, with their class names.
pub fn load_fashion_mnist() -> Result<Splits> {
    let splits = load_mnist_dir(&fashion_mnist_dir()?)?;
    let names = || CLASS_NAMES.iter().map(|n| n.to_string()).collect::<Vec<_>>();
    Ok(Splits {
        train: splits.train.with_class_names(names())?,
        test: splits.test.map(|t| t.with_class_names(names())).transpose()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_absent_package_is_named_and_the_variable_wins() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("fashion-mnist");
        let e = find_dir(None, &missing).unwrap_err().to_string();
        assert_eq!(
            e,
            format!(
                "{}: not found: install Debian's dataset-fashion-mnist package (apt-get install dataset-fashion-mnist), or point LOCKSTEP_FASHION_MNIST_DIR at a directory of the four Fashion-MNIST IDX files",
                missing.display()
            )
        );
        assert_eq!(find_dir(Some(dir.path().into()), &missing).unwrap(), dir.path());
        // An empty variable is unset.
        assert!(find_dir(Some("".into()), &missing).is_err());
    }
}
