//! Stop strings: where a stream's text ends, searched token by token.

/// Where in `text` generation should stop, if a stop string appears: the byte index where the
/// earliest one starts.
pub fn find_stop(text: &str, stops: &[String]) -> Option<usize> {
    find_stop_after(text, stops, 0)
}

/// [`find_stop`] for the stop strings that end past byte `new` of `text`: those that take
/// part of the text from `new` on. What lay wholly before it was looked at when it was new
/// (or, before `min_tokens`, is not to stop the stream, as vLLM has it), so each token
/// searches its own text and a stop string's length back, not the whole text again (which
/// made a sequence's stop checks quadratic in its length).
pub fn find_stop_after(text: &str, stops: &[String], new: usize) -> Option<usize> {
    stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| {
            // Every match from here ends past `new`, and none that does starts earlier (a
            // match starts on a character boundary).
            let from = ceil_char_boundary(text, new.saturating_sub(s.len() - 1));
            text[from..].find(s.as_str()).map(|at| from + at)
        })
        .min()
}

/// The smallest character boundary of `s` at or above `i` (its length past the end).
fn ceil_char_boundary(s: &str, mut i: usize) -> usize {
    while i < s.len() && !s.is_char_boundary(i) {
        i += 1;
    }
    i.min(s.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings() {
        assert_eq!(
            find_stop("hello world", &["wor".into(), "xyz".into()]),
            Some(6)
        );
        assert_eq!(find_stop("hello", &["".into()]), None);
    }

    /// Text appended piece by piece, each new piece searched with [`find_stop_after`] from
    /// piece `from` on (the `min_tokens` of a stream): the first stop found, and when, is the
    /// brute-force search's over every position, counting only the matches that end past
    /// the text present before piece `from`.
    #[test]
    fn the_tail_search_finds_what_the_whole_search_finds() {
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: usize| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng % n as u64) as usize
        };
        let pieces = [
            "a",
            "b",
            "ab",
            "ba",
            "é",
            "aé",
            "\u{1F600}",
            "bb",
            "aaa",
            "",
        ];
        let letters = ["a", "b", "é", "\u{1F600}"];
        let brute = |text: &str, stops: &[String], boundary: usize| {
            (0..=text.len())
                .filter(|p| text.is_char_boundary(*p))
                .find(|p| {
                    stops.iter().any(|s| {
                        !s.is_empty()
                            && text[*p..].starts_with(s.as_str())
                            && p + s.len() > boundary
                    })
                })
        };
        for _ in 0..5000 {
            let stops: Vec<String> = (0..1 + next(3))
                .map(|_| (0..next(5)).map(|_| letters[next(letters.len())]).collect())
                .collect();
            let from = next(8);
            let (mut text, mut boundary) = (String::new(), 0);
            for i in 0..12 {
                if i == from {
                    boundary = text.len();
                }
                let new = text.len();
                text.push_str(pieces[next(pieces.len())]);
                if i < from {
                    continue;
                }
                let found = find_stop_after(&text, &stops, new);
                assert_eq!(
                    found,
                    brute(&text, &stops, boundary),
                    "{text:?} {stops:?} from {from}"
                );
                if found.is_some() {
                    break;
                }
            }
        }
    }
}
