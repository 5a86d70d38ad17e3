"""Measurement: the moment probe, GR scaling and the weight-to-gradient ratio, curvature (Hessian
and Gauss-Newton blocks, Figure 2) and loss landscapes."""
