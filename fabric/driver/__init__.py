"""Running a fabric from a driver: finding or starting the Ray cluster
(``cluster``) and the whole fabric in one process (``local``)."""
