//! Model-server metrics (Prometheus text) → replica load. (In progress.)
