//! Memory-mapped safetensors files of a checkpoint (one `model.safetensors` or shards listed in
//! `model.safetensors.index.json`). Tensors are views into the maps: nothing is copied.

use crate::error::{MegaError, Result};
use memmap2::Mmap;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

struct Shard {
    path: PathBuf,
    map: Mmap,
}

#[derive(Clone, Debug)]
struct Entry {
    shard: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Byte range inside the shard's map.
    start: usize,
    end: usize,
}

/// The tensors of a checkpoint directory, memory-mapped.
pub struct TensorStore {
    shards: Vec<Shard>,
    entries: BTreeMap<String, Entry>,
}

/// Name of the index file of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Name of the single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";

/// Why a file the safetensors parser refused is unusable, when the reason is one a user can act
/// on: too short for its 8-byte header length, a header longer than the file, or tensor data past
/// its end (a truncated download or copy) — each with the sizes. `None`: not a truncation.
fn truncation(path: &Path, file: &[u8]) -> Option<MegaError> {
    let len = file.len();
    let Some(head) = file.get(..8) else {
        return Some(MegaError::file(
            path,
            format!("is truncated: {len} bytes, but a safetensors file starts with an 8-byte header length"),
        ));
    };
    let n = u64::from_le_bytes(head.try_into().expect("8 bytes"));
    if n > (len as u64).saturating_sub(8) {
        return Some(MegaError::file(
            path,
            format!(
                "is truncated or not a safetensors file: its header length says {n} bytes, but only {} \
                 bytes follow",
                len - 8
            ),
        ));
    }
    // The data section must hold every tensor's byte range (the header's largest end offset).
    let header = &file[8..8 + n as usize];
    let serde_json::Value::Object(meta) = serde_json::from_slice::<serde_json::Value>(header).ok()? else {
        return None;
    };
    let end = meta
        .iter()
        .filter(|(k, _)| k.as_str() != "__metadata__")
        .filter_map(|(_, v)| v.get("data_offsets")?.as_array()?.get(1)?.as_u64())
        .max()?;
    let data = (len - 8 - n as usize) as u64;
    (end > data).then(|| {
        MegaError::file(
            path,
            format!("is truncated: its header describes {end} bytes of tensor data, the file holds {data}"),
        )
    })
}

impl TensorStore {
    /// Opens `dir/model.safetensors.index.json` (and its shards) or else `dir/model.safetensors`.
    pub fn open_dir(dir: &Path) -> Result<TensorStore> {
        let index = dir.join(INDEX_FILE);
        if index.exists() {
            let v = crate::config::read_json(&index)?;
            let map = v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| {
                MegaError::file(&index, "has no `weight_map` object (tensor name -> shard file)")
            })?;
            let mut files = BTreeSet::new();
            let mut listed = Vec::with_capacity(map.len());
            for (name, f) in map {
                let f = f.as_str().ok_or_else(|| {
                    MegaError::file(&index, format!("weight_map[`{name}`] is {f}, expected a file name"))
                })?;
                // Shard names are plain file names next to the index: refuse paths that escape it.
                if f.contains('/') || f.contains('\\') || f == ".." {
                    return Err(MegaError::file(
                        &index,
                        format!("weight_map[`{name}`] = `{f}` is not a file name"),
                    ));
                }
                files.insert(f.to_string());
                listed.push((name.clone(), f.to_string()));
            }
            let paths: Vec<PathBuf> = files.iter().map(|f| dir.join(f)).collect();
            let store = TensorStore::open_files(&paths)?;
            for (name, f) in listed {
                match store.entries.get(&name) {
                    Some(e)
                        if store.shards[e.shard].path.file_name().and_then(|s| s.to_str()) == Some(&f) => {}
                    Some(e) => {
                        return Err(MegaError::tensor(
                            name,
                            format!(
                                "{INDEX_FILE} places it in {f} but it is in {}",
                                store.shards[e.shard].path.display()
                            ),
                        ))
                    }
                    None => {
                        return Err(MegaError::tensor(
                            name,
                            format!("listed in {INDEX_FILE} under {f}, but that file does not hold it"),
                        ))
                    }
                }
            }
            Ok(store)
        } else {
            let single = dir.join(SINGLE_FILE);
            if !single.exists() {
                return Err(MegaError::file(
                    dir,
                    format!("no {SINGLE_FILE} and no {INDEX_FILE}: not a checkpoint directory"),
                ));
            }
            TensorStore::open_files(&[single])
        }
    }

    /// Maps the given safetensors files; a tensor name in two files is an error.
    pub fn open_files(paths: &[PathBuf]) -> Result<TensorStore> {
        let mut shards = Vec::with_capacity(paths.len());
        let mut entries = BTreeMap::new();
        for (i, path) in paths.iter().enumerate() {
            let file = std::fs::File::open(path).map_err(|e| MegaError::file(path, e))?;
            // SAFETY: the map is read-only; like every safetensors reader we assume the file is not
            // truncated by another process while mapped.
            let map =
                unsafe { Mmap::map(&file) }.map_err(|e| MegaError::file(path, format!("cannot map: {e}")))?;
            // The parser's verdict first; only a file it refuses is measured for a truncation.
            let (n, meta) = SafeTensors::read_metadata(&map).map_err(|e| {
                truncation(path, &map)
                    .unwrap_or_else(|| MegaError::file(path, format!("not a valid safetensors file: {e}")))
            })?;
            let base = 8 + n;
            for (name, info) in meta.tensors() {
                let e = Entry {
                    shard: i,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    start: base + info.data_offsets.0,
                    end: base + info.data_offsets.1,
                };
                if let Some(prev) = entries.insert(name.clone(), e) {
                    return Err(MegaError::tensor(
                        name,
                        format!("present in both {} and {}", paths[prev.shard].display(), path.display()),
                    ));
                }
            }
            shards.push(Shard { path: path.clone(), map });
        }
        Ok(TensorStore { shards, entries })
    }

    /// A view of tensor `name` (borrowed from the map).
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        let e =
            self.entries.get(name).ok_or_else(|| MegaError::tensor(name, "missing from the checkpoint"))?;
        let data = &self.shards[e.shard].map[e.start..e.end];
        TensorView::new(e.dtype, e.shape.clone(), data)
            .map_err(|err| MegaError::tensor(name, format!("{err}")))
    }

    /// Dtype and shape without touching the data.
    pub fn info(&self, name: &str) -> Option<(Dtype, &[usize])> {
        self.entries.get(name).map(|e| (e.dtype, e.shape.as_slice()))
    }

    /// Whether the checkpoint holds `name`.
    pub fn has(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// All tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(|s| s.as_str())
    }

    /// Names that start with `prefix`, sorted.
    pub fn names_with_prefix<'a>(&'a self, prefix: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.entries
            .range(prefix.to_string()..)
            .map(|(k, _)| k.as_str())
            .take_while(move |k| k.starts_with(prefix))
    }

    /// The safetensors files, in shard order.
    pub fn files(&self) -> Vec<&Path> {
        self.shards.iter().map(|s| s.path.as_path()).collect()
    }

    /// The file holding `name`.
    pub fn file_of(&self, name: &str) -> Option<&Path> {
        self.entries.get(name).map(|e| self.shards[e.shard].path.as_path())
    }
}
