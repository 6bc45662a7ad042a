"""What the cluster families (Kubeflow, KServe) share: the connection to a namespace and the boundary
where the client's errors become one line (``api``), the names, labels and paths of kubetune's objects
(``objects``), and the check of rendered objects against the official typed models (``strict``)."""
