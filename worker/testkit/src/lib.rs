//! What the worker's tests build on and the worker binary does not ship: a generator of small
//! deterministic random-weight models in the formats the worker loads.

pub mod testmodel;
