//! The exact CPU reference forward: the oracle every other backend is tested against.
