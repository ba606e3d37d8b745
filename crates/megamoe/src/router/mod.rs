//! The router: scores, biased top-k, hash routing, weight normalisation.
