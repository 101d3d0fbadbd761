//! Named f32 tensors in safetensors files, written atomically.

use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::{Dtype, TensorView};

use crate::fsutil::write_atomic_with;

/// Errors of tensor files.
#[derive(Debug, thiserror::Error)]
pub enum TensorFileError {
    /// The file cannot be read.
    #[error("cannot read {path}: {error}")]
    Read {
        /// The path.
        path: String,
        /// The I/O error (shown in the message, not chained, so the CLI's
        /// one-line error does not repeat it).
        error: std::io::Error,
    },
    /// The file cannot be written.
    #[error("cannot write {path}: {error}")]
    Write {
        /// The path.
        path: String,
        /// The I/O error (in the message, not chained).
        error: std::io::Error,
    },
    /// The file is not a valid safetensors file.
    #[error("{path}: not a valid safetensors file ({reason})")]
    Format {
        /// The path.
        path: String,
        /// The parser's complaint.
        reason: String,
    },
    /// The file is valid safetensors but not what the reader expects.
    #[error("{path}: {reason}")]
    Content {
        /// The path.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// A tensor is missing, has another dtype or shape.
    #[error("{path}: tensor {name}: {reason}")]
    Tensor {
        /// The path.
        path: String,
        /// The tensor.
        name: String,
        /// What is wrong.
        reason: String,
    },
}

/// A tensor to write: name, shape, data (row-major f32).
pub type NamedTensor<'a> = (String, Vec<usize>, &'a [f32]);

/// Writes tensors and string metadata atomically, streaming each tensor's
/// bytes to the file (no copy of the whole file in memory).
pub fn save(
    path: &Path,
    tensors: &[NamedTensor<'_>],
    metadata: HashMap<String, String>,
) -> Result<(), TensorFileError> {
    let fmt = |reason: String| TensorFileError::Format {
        path: path.display().to_string(),
        reason,
    };
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, shape, data)| {
            TensorView::new(Dtype::F32, shape.clone(), bytemuck_f32(data))
                .map(|v| (name.clone(), v))
                .map_err(|e| fmt(e.to_string()))
        })
        .collect::<Result<_, _>>()?;
    write_atomic_with(path, |tmp| {
        safetensors::serialize_to_file(views, Some(metadata), tmp).map_err(|e| match e {
            safetensors::SafeTensorError::IoError(io) => io,
            other => std::io::Error::other(other.to_string()),
        })
    })
    .map_err(|error| TensorFileError::Write {
        path: path.display().to_string(),
        error,
    })
}

/// Bytes [`save`] writes for `tensors` of these element counts, at most:
/// the f32 data, and a header of at most `HEADER_BYTES_PER_TENSOR` per
/// tensor beside the metadata's `metadata_bytes`.
pub fn saved_bytes_bound(elements: impl IntoIterator<Item = usize>, metadata_bytes: usize) -> u64 {
    let (mut n, mut data) = (0u64, 0u64);
    for e in elements {
        n += 1;
        data += 4 * e as u64;
    }
    data + n * HEADER_BYTES_PER_TENSOR + 2 * metadata_bytes as u64 + 4096
}

/// Header bytes one tensor takes at most (name up to 128 bytes, dtype,
/// shape of up to 4 dimensions, offsets).
const HEADER_BYTES_PER_TENSOR: u64 = 320;

/// The little-endian bytes of `data` (safetensors is little-endian, as is
/// every host this crate builds for).
fn bytemuck_f32(data: &[f32]) -> &[u8] {
    const _: () = assert!(
        cfg!(target_endian = "little"),
        "safetensors needs a little-endian host"
    );
    bytemuck::cast_slice(data)
}

/// Tensors (shape, data) by name and the metadata of a file.
pub struct Loaded {
    /// Tensors by name.
    pub tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
    /// String metadata.
    pub metadata: HashMap<String, String>,
    path: String,
}

impl Loaded {
    /// Takes tensor `name`, checking its shape and that every value is
    /// finite.
    pub fn take(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>, TensorFileError> {
        let err = |reason: String| TensorFileError::Tensor {
            path: self.path.clone(),
            name: name.to_string(),
            reason,
        };
        let (s, data) = self
            .tensors
            .remove(name)
            .ok_or_else(|| err("missing".into()))?;
        if s != shape {
            return Err(err(format!("shape {s:?}, expected {shape:?}")));
        }
        if let Some(i) = data.iter().position(|v| !v.is_finite()) {
            return Err(err(format!("non-finite value {} at element {i}", data[i])));
        }
        Ok(data)
    }

    /// The shape of tensor `name`, if the file has it.
    pub fn shape(&self, name: &str) -> Result<&[usize], TensorFileError> {
        self.tensors
            .get(name)
            .map(|(s, _)| s.as_slice())
            .ok_or_else(|| TensorFileError::Tensor {
                path: self.path.clone(),
                name: name.to_string(),
                reason: "missing".into(),
            })
    }

    /// Metadata value `key`.
    pub fn meta(&self, key: &str) -> Result<&str, TensorFileError> {
        self.metadata
            .get(key)
            .map(String::as_str)
            .ok_or_else(|| TensorFileError::Format {
                path: self.path.clone(),
                reason: format!("metadata field {key} is missing"),
            })
    }
}

/// Reads every f32 tensor of a safetensors file.
pub fn load(path: &Path) -> Result<Loaded, TensorFileError> {
    let p = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|error| TensorFileError::Read {
        path: p.clone(),
        error,
    })?;
    let st =
        safetensors::SafeTensors::deserialize(&bytes).map_err(|e| TensorFileError::Format {
            path: p.clone(),
            reason: e.to_string(),
        })?;
    let (_, meta) =
        safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| TensorFileError::Format {
            path: p.clone(),
            reason: e.to_string(),
        })?;
    let mut tensors = HashMap::new();
    for name in st.names() {
        let v = st.tensor(name).map_err(|e| TensorFileError::Format {
            path: p.clone(),
            reason: e.to_string(),
        })?;
        if v.dtype() != Dtype::F32 {
            return Err(TensorFileError::Tensor {
                path: p.clone(),
                name: name.to_string(),
                reason: format!("dtype {:?}, expected F32", v.dtype()),
            });
        }
        let data: Vec<f32> = v
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        tensors.insert(name.to_string(), (v.shape().to_vec(), data));
    }
    Ok(Loaded {
        tensors,
        metadata: meta.metadata().clone().unwrap_or_default(),
        path: p,
    })
}
