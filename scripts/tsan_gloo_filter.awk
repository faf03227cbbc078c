# scripts/tsan.sh's filter of the distributed run's ThreadSanitizer reports
# (see the comment there): prints every report except those in which each
# thread other than the main one that takes part in the race is a thread of
# a Gloo process group, started while gloo_groups' group or pair factory
# (src/dist/gloo.cpp) made one.
function flush(   t, others, all_gloo) {
  if (report != "") {
    others = 0
    all_gloo = 1
    for (t in racing) {
      others++
      if (!(t in gloo)) all_gloo = 0
    }
    if (others == 0 || !all_gloo) printf "%s", report
  }
  report = ""
  thread = ""
  delete racing
  delete gloo
}
/^==================$/ && report ~ /SUMMARY: ThreadSanitizer/ {
  report = report $0 "\n"
  flush()
  next
}
/^  (Previous )?(atomic )?([Ww]rite|[Rr]ead) of size [0-9]+ at .* by thread T[0-9]+/ {
  match($0, /by thread T[0-9]+/)
  racing[substr($0, RSTART + 10, RLENGTH - 10)] = 1
}
/^  Thread T[0-9]+ .* created by / {
  match($0, /T[0-9]+/)
  thread = substr($0, RSTART, RLENGTH)
}
thread != "" && /gloo_groups\(.*<lambda\(const c10::intrusive_ptr<c10d::Store>&/ {
  gloo[thread] = 1
}
/^$/ { thread = "" }
{ report = report $0 "\n" }
END { flush() }
