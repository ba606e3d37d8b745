//! Diagnostics: the checkpoint doctor.
