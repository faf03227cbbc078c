# scripts/tsan.sh's filter of the distributed run's ThreadSanitizer reports
# (see the comment there). It prints every report except those of an
# object's lifetime across a thread of a Gloo process group (one started
# while gloo_groups' group or pair factory, in src/dist/gloo.cpp, made a
# group), in which that thread runs none of our code:
#   - the Gloo thread frees memory (free, operator delete) that another
#     thread touched before: the last reference to a work, its future or
#     its tensors, dropped inside LibTorch by a decrement TSan does not see;
#   - or the other thread destroys a mutex or condition variable the Gloo
#     thread signalled (a work the caller let go of after its wait);
#   - or both threads are Gloo's.
# A race in which the Gloo thread runs our code (a hook, a callback), or
# copies or reads memory our threads use, is printed, as is every race
# between our own threads (the main one included).
function flush(   k, g, o, n_gloo, n_other, drop) {
  if (report != "") {
    n_gloo = 0
    n_other = 0
    for (k = 1; k <= accesses; k++) {
      if (who[k] in gloo) {
        n_gloo++
        g = k
      } else {
        n_other++
        o = k
      }
    }
    drop = 0
    if (accesses == 2 && n_gloo == 2) {
      drop = stack[1] !~ /gpipe::/ && stack[2] !~ /gpipe::/
    } else if (accesses == 2 && n_gloo == 1) {
      drop = stack[g] !~ /gpipe::/ &&
             (top[g] ~ /(^| )(free|operator delete)/ ||
              top[o] ~ /pthread_(cond|mutex)_destroy/)
    }
    if (!drop) printf "%s", report
  }
  report = ""
  accesses = 0
  in_access = 0
  thread = ""
  delete who
  delete stack
  delete top
  delete gloo
}
/^==================$/ && report ~ /SUMMARY: ThreadSanitizer/ {
  report = report $0 "\n"
  flush()
  next
}
/^  (Previous )?([Aa]tomic )?([Ww]rite|[Rr]ead) of size [0-9]+ at / {
  accesses++
  if (match($0, /by thread T[0-9]+/)) {
    who[accesses] = substr($0, RSTART + 10, RLENGTH - 10)
  } else {
    who[accesses] = "main"
  }
  stack[accesses] = ""
  top[accesses] = ""
  in_access = 1
  report = report $0 "\n"
  next
}
in_access && /^    #[0-9]+ / {
  stack[accesses] = stack[accesses] $0 "\n"
  if ($0 ~ /^    #0 /) top[accesses] = $0
}
/^  Thread T[0-9]+ .* created by / {
  match($0, /T[0-9]+/)
  thread = substr($0, RSTART, RLENGTH)
  in_access = 0
}
thread != "" && /gloo_groups\(.*<lambda\(const c10::intrusive_ptr<c10d::Store>&/ {
  gloo[thread] = 1
}
/^$/ {
  thread = ""
  in_access = 0
}
{ report = report $0 "\n" }
END { flush() }
