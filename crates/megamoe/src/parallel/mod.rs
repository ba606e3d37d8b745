//! Expert parallelism: which rank owns which experts.
